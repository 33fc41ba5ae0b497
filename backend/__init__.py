"""HyperHarness backend: engine install, typed profiles, pool geometry, embedded models, `serve`."""

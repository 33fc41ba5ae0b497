"""`serve`'s plan for several engines: each its own port, key, devices and KV-event socket, all listed in the
one runtime config; or remote engines by URL; or the engines alone (a compose engine service)."""
from __future__ import annotations

import json

import pytest

from backend.launcher import engine_argv
from backend.profiles import KVEvents, load_profile
from backend.serve import ServeError, plan
from proxy.settings import Settings

pytestmark = pytest.mark.unit


def _plan(tmp_path, monkeypatch, profile="cpu-smol", **kw):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("HYPERHARNESS_API_KEY", raising=False)
    return plan(load_profile(profile), host=None, port=None, engine_port=kw.pop("engine_port", 9100), use_key=False,
                key_file=None, prepare=False, run_dir=tmp_path, **kw)


def test_n_cpu_engines_each_with_port_key_and_core(tmp_path, monkeypatch):
    p = _plan(tmp_path, monkeypatch, engines=3)
    ups = p.proxy.upstreams
    assert [u.name for u in ups] == ["engine-0", "engine-1", "engine-2"]
    assert [u.url for u in ups] == [f"http://127.0.0.1:{9100 + i}" for i in range(3)]
    assert len({u.api_key_file for u in ups}) == 3 and len({e.key for e in p.engines}) == 3
    assert [e.argv[e.argv.index("--port") + 1] for e in p.engines] == ["9100", "9101", "9102"]
    assert len({e.env["VLLM_CPU_OMP_THREADS_BIND"] for e in p.engines[:2]}) == 2
    assert all(u.geometry == ups[0].geometry and u.geometry.seats == 4 for u in ups)
    # the written config round-trips through the proxy's own loader
    p.proxy.dump(tmp_path / "proxy.json")
    assert len(Settings.model_validate(json.loads((tmp_path / "proxy.json").read_text())).upstreams) == 3


def test_one_engine_is_unchanged(tmp_path, monkeypatch):
    p = _plan(tmp_path, monkeypatch)
    assert len(p.engines) == 1 and p.engines[0].env == {} and p.engines[0].log_name == "engine.log"
    assert p.engines[0].key_file.name == "engine_api_key"


def test_gpu_engines_one_card_each_from_the_visible_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    p = _plan(tmp_path, monkeypatch, profile="gpu-long", engines=2)
    assert [e.env["CUDA_VISIBLE_DEVICES"] for e in p.engines] == ["3", "5"]
    with pytest.raises(ServeError, match="needs 4 GPU"):  # two cards per pipeline-parallel engine
        _plan(tmp_path, monkeypatch, profile="gpu-pp2", engines=2)


def test_remote_upstreams_start_no_engine(tmp_path, monkeypatch):
    key = tmp_path / "engine.key"
    key.write_text("k\n")
    p = _plan(tmp_path, monkeypatch, upstreams=["http://a:8100/", "http://b:8100"], upstream_key_file=key)
    assert p.engines == ()
    assert [(u.name, u.url, u.api_key_file) for u in p.proxy.upstreams] == [
        ("engine-0", "http://a:8100", key), ("engine-1", "http://b:8100", key)]
    with pytest.raises(ServeError, match="not both"):
        _plan(tmp_path, monkeypatch, upstreams=["http://a:1"], engines=2)


def test_engine_only_beyond_loopback_needs_a_shared_key(tmp_path, monkeypatch):
    with pytest.raises(ServeError, match="engine-key-file"):
        _plan(tmp_path, monkeypatch, engine_only=True, engine_host="0.0.0.0")
    key = tmp_path / "engine.key"
    key.write_text("shared\n")
    p = _plan(tmp_path, monkeypatch, engine_only=True, engine_host="0.0.0.0", engine_key_file=key)
    e = p.engines[0]
    assert p.engine_only and e.key == "shared" and e.argv[e.argv.index("--host") + 1] == "0.0.0.0"
    assert all(path != key for path, _ in p.written_keys)  # the shared key file is not ours to remove


def test_kv_events_flag_per_engine_socket(tmp_path):
    prof = load_profile("cpu-smol")
    prof = prof.model_copy(update={"engine": prof.engine.model_copy(update={"kv_events": KVEvents(
        endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600")})})
    cfgs = []
    for i in range(2):
        argv = engine_argv(prof, tmp_path, 8100 + i, index=i)
        cfgs.append(json.loads(argv[argv.index("--kv-events-config") + 1]))
    assert cfgs[0]["enable_kv_cache_events"] and cfgs[0]["publisher"] == "zmq"
    assert [c["endpoint"] for c in cfgs] == ["tcp://*:5557", "tcp://*:5558"]
    assert [c["replay_endpoint"] for c in cfgs] == ["tcp://*:5600", "tcp://*:5601"]
    assert "--kv-events-config" not in engine_argv(load_profile("cpu-smol"), tmp_path, 8100)


def test_client_key_files_reach_the_proxy_and_a_bad_one_is_refused_before_boot(tmp_path, monkeypatch):
    team = tmp_path / "team.keys"
    team.write_text("# the team\nk-alice\n\nk-bob\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("HYPERHARNESS_API_KEY", "k-main")
    p = plan(load_profile("cpu-smol"), host=None, port=None, engine_port=9100, use_key=True, key_file=None,
             prepare=False, run_dir=tmp_path, client_key_files=[team])
    for path, key in p.written_keys:  # what `run` writes before it starts anything
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(key + "\n")
    p.proxy.dump(tmp_path / "proxy.json")
    loaded = Settings.load(tmp_path / "proxy.json")
    assert set(loaded.keys) == {"k-main", "k-alice", "k-bob"}
    (tmp_path / "empty.keys").write_text("# nobody\n")
    with pytest.raises(ServeError, match="holds no key"):
        plan(load_profile("cpu-smol"), host=None, port=None, engine_port=9100, use_key=True, key_file=None,
             prepare=False, run_dir=tmp_path, client_key_files=[tmp_path / "empty.keys"])
    with pytest.raises(ServeError, match="--no-key"):
        _plan(tmp_path, monkeypatch, client_key_files=[team])

"""The vLLM plugin's pure-Python parts on CPU: switches, the auth middleware, kernel routing."""
from __future__ import annotations

import importlib.metadata

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from backend.plugin import PluginSettings, attention, auth, gdn

pytestmark = pytest.mark.unit

KEY = "sk-test"


def test_entry_point_is_registered() -> None:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert {ep.value for ep in eps if ep.name == "hyperharness"} == {"backend.plugin:register"}


def test_settings_defaults_and_switches() -> None:
    assert PluginSettings.from_env({}) == PluginSettings()
    s = PluginSettings.from_env({"HYPERHARNESS_ENGINE_AUTH": "0", "HYPERHARNESS_VERIFY_ATTN": "1"})
    assert (s.engine_auth, s.verify_attention, s.gdn_lazy) == (False, True, False)
    with pytest.raises(ValueError, match="HYPERHARNESS_PLUGIN must be 0 or 1, got 'yes'"):
        PluginSettings.from_env({"HYPERHARNESS_PLUGIN": "yes"})


@pytest.mark.parametrize(
    ("path", "method", "guarded"),
    [
        ("/health", "GET", False),
        ("/health/", "GET", False),
        ("/invocations", "POST", True),
        ("/tokenize", "POST", True),
        ("/detokenize", "POST", True),
        ("/metrics", "GET", True),
        ("/load", "GET", True),
        ("/ping", "GET", True),
        ("/version", "GET", True),
        ("/v1/completions", "POST", True),
        ("/healthz", "GET", True),
        ("/", "GET", True),
        ("/tokenize", "OPTIONS", False),
    ],
)
def test_guarded_paths(path: str, method: str, guarded: bool) -> None:
    assert auth.is_guarded(path, method) is guarded


def test_install_rebinds_vllm_middleware_idempotently() -> None:
    import vllm.entrypoints.serve.middleware.authenticate as upstream

    assert auth.install() and auth.install()
    assert getattr(upstream.AuthenticationMiddleware, "hyperharness", False)


async def test_middleware_refuses_every_route_but_health() -> None:
    import vllm.entrypoints.serve.middleware.authenticate as upstream

    auth.install()

    async def ok(_request: object) -> PlainTextResponse:
        return PlainTextResponse("ok")

    paths = ["/health", "/invocations", "/tokenize", "/metrics", "/v1/models"]
    app = Starlette(routes=[Route(p, ok, methods=["GET", "POST"]) for p in paths])
    app.add_middleware(upstream.AuthenticationMiddleware, tokens=[KEY])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://e") as client:
        assert (await client.get("/health")).status_code == 200
        for path in paths[1:]:
            assert (await client.post(path)).status_code == 401, path
            wrong = await client.post(path, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401, path
            right = await client.post(path, headers={"Authorization": f"Bearer {KEY}"})
            assert right.status_code == 200, path


class _Mode:
    def __init__(self, name: str) -> None:
        self.name = name


def _verify_call(**overrides: object) -> dict[str, object]:
    call: dict[str, object] = {
        "kv_quant_mode": _Mode("INT8_PER_TOKEN_HEAD"),
        "max_seqlen_q": 8,
        "causal": True,
        "softcap": 0,
        "window_size": (-1, -1),
        "k_scale_cache": object(),
        "v_scale_cache": object(),
        "chunk_lookback": -1,
    }
    call.update(overrides)
    return call


@pytest.mark.parametrize(
    ("overrides", "routed"),
    [
        ({}, True),
        ({"max_seqlen_q": 16}, True),
        ({"window_size": (2047, 0)}, True),  # the drafter's sliding window
        ({"max_seqlen_q": 1}, False),  # plain decode: upstream 3D split-KV is fine
        ({"max_seqlen_q": 17}, False),  # prefill chunk
        ({"kv_quant_mode": _Mode("NONE")}, False),
        ({"kv_quant_mode": _Mode("FP8_PER_TOKEN_HEAD")}, False),
        ({"causal": False}, False),
        ({"softcap": 30.0}, False),
        ({"sinks": object()}, False),
        ({"alibi_slopes": object()}, False),
        ({"q_descale": object()}, False),
        ({"output_scale": object()}, False),
        ({"chunk_lookback": 4}, False),
        ({"k_scale_cache": None}, False),
        ({"window_size": (16, 16)}, False),
    ],
)
def test_verify_attention_routing(overrides: dict[str, object], routed: bool) -> None:
    assert attention.route_to_verify_kernel(_verify_call(**overrides), max_verify_tokens=16) is routed


def test_router_sends_calls_to_the_right_function() -> None:
    calls: list[str] = []

    def upstream(**call: object) -> str:
        calls.append("upstream")
        return "u"

    def kernel(**call: object) -> str:
        calls.append(f"kernel window={call['window_size']}")
        return "k"

    route = attention.make_router(upstream, kernel, max_verify_tokens=16)
    base = {"q": 0, "k": 0, "v": 0, "out": 0, "cu_seqlens_q": 0, "seqused_k": 0, "max_seqlen_k": 9,
            "softmax_scale": 0.1, "block_table": 0}  # fmt: skip
    assert route(**base, **_verify_call(window_size=None)) == "k"
    assert route(**base, **_verify_call(max_seqlen_q=1)) == "u"
    assert calls == ["kernel window=(-1, -1)", "upstream"]


@pytest.mark.parametrize(
    ("changes", "lazy"),
    [
        ({}, True),
        ({"num_spec_rows": 1}, False),  # mixed batch: commit, then upstream
        ({"tokens_per_row": 1}, False),
        ({"tokens_per_row": 17}, False),
        ({"key_dim": 64}, False),
        ({"state_dtype": "float8"}, False),
    ],
)
def test_gdn_lazy_commit_routing(changes: dict[str, object], lazy: bool) -> None:
    batch = {"num_spec_rows": 2, "num_rows": 2, "tokens_per_row": 8, "key_dim": 128, "value_dim": 128,
             "state_dtype": "float16", "log_capacity": 16}  # fmt: skip
    batch.update(changes)
    assert gdn.route_to_lazy_commit(gdn.GdnBatch(**batch)) is lazy  # type: ignore[arg-type]


def test_gdn_lazy_install_registers_the_oot_layer() -> None:
    from vllm.model_executor.custom_op import op_registry_oot

    gdn.install()
    assert gdn.install() is False  # idempotent
    assert op_registry_oot["QwenGatedDeltaNetAttention"].__name__ == "LazyQwenGDN"

"""compose.yaml against the Compose specification's own JSON schema (the copy check-jsonschema vendors and
keeps current, no Docker engine needed), plus what the schema cannot know: every service is health
checked, the three profiles exist, the replicas' proxies share Redis and list both engines, the load
balancer reaches both proxies, and the engines get distinct ports and cards."""
from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import yaml

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _flag(cmd: list[str], name: str) -> list[str]:
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == name]


def _in(compose: dict, profile: str) -> dict[str, dict]:
    return {n: s for n, s in compose["services"].items() if profile in s.get("profiles", ())}


def test_valid_against_the_compose_specification(compose):
    schema = json.loads(resources.files("check_jsonschema.builtin_schemas.vendor")
                        .joinpath("compose-spec.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)
    # and the schema is strict enough to catch a misspelt key
    bad = {**compose, "services": {**compose["services"], "redis": {**compose["services"]["redis"], "helthcheck": {}}}}
    assert not validator.is_valid(bad)


def test_profiles_and_health_checks(compose):
    services = compose["services"]
    assert {p for s in services.values() for p in s.get("profiles", ())} == {"single", "replicas", "cpu"}
    for name, s in services.items():
        assert s.get("profiles"), f"{name} starts in every profile"
        test = s.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no health check"
        for dep in s.get("depends_on", {}):  # a dependency runs in every profile of its dependent
            assert set(s["profiles"]) <= set(services[dep]["profiles"]), f"{name} -> {dep}"
    for name, s in services.items():  # every secret a service mounts is defined
        assert set(s.get("secrets", ())) <= set(compose.get("secrets", {})), name


def test_replicas_engines_proxies_redis_and_lb(compose):
    rep = _in(compose, "replicas")
    engines = {n: s for n, s in rep.items() if "--engine-only" in s.get("command", ())}
    proxies = {n: s for n, s in rep.items() if "--upstream" in s.get("command", ())}
    assert len(engines) == 2 and len(proxies) == 2
    ports = {n: _flag(s["command"], "--engine-port")[0] for n, s in engines.items()}
    cards = {n: tuple(d["device_ids"]) for n, s in engines.items()
             for d in s["deploy"]["resources"]["reservations"]["devices"]}
    assert len(set(ports.values())) == 2 and len(set(cards.values())) == 2
    for n, s in engines.items():
        assert f":{ports[n]}/health" in " ".join(s["healthcheck"]["test"])  # checks its own port
        assert _flag(s["command"], "--engine-key-file") == ["/run/secrets/engine_key"]
    want = {f"http://{n}:{p}" for n, p in ports.items()}
    redis = [n for n, s in rep.items() if str(s.get("image", "")).startswith(("redis", "valkey"))]
    assert len(redis) == 1
    for n, s in proxies.items():
        cmd = s["command"]
        assert set(_flag(cmd, "--upstream")) == want, n
        assert _flag(cmd, "--redis-url") == [f"redis://{redis[0]}:6379/0"], n
        assert _flag(cmd, "--upstream-key-file") == ["/run/secrets/engine_key"], n
        assert {redis[0], *engines} <= set(s["depends_on"]), n
    # nginx's upstream block names exactly the proxies, on the port each listens on
    lb = next(s for s in rep.values() if str(s.get("image", "")).startswith("nginx"))
    conf_path = next(v.split(":")[0] for v in lb["volumes"] if v.endswith("nginx.conf:ro"))
    conf = (ROOT / conf_path).read_text()
    servers = set(re.findall(r"^\s*server\s+([\w.-]+:\d+)", conf, re.M))
    assert servers == {f"{n}:{_flag(s['command'], '--port')[0]}" for n, s in proxies.items()}
    assert set(proxies) <= set(lb["depends_on"])
    assert {"prometheus", "grafana"} <= set(rep)
    # Prometheus scrapes exactly the proxies, with the clients' key the compose secret mounts
    prom = rep["prometheus"]
    prom_path = next(v.split(":")[0] for v in prom["volumes"] if v.endswith("prometheus.yml:ro"))
    scrape = yaml.safe_load((ROOT / prom_path).read_text())["scrape_configs"]
    job = next(j for j in scrape if j["job_name"] == "hyperharness-proxy")
    assert set(job["static_configs"][0]["targets"]) == {f"{n}:{_flag(s['command'], '--port')[0]}"
                                                         for n, s in proxies.items()}
    assert job["authorization"]["credentials_file"] == "/run/secrets/api_key" and "api_key" in prom["secrets"]


def test_cpu_profile_runs_the_embedded_model_without_a_gpu(compose):
    (name, svc), = _in(compose, "cpu").items()
    assert "--profile cpu-smol" in " ".join(svc["command"]) and svc["environment"]["HYPERHARNESS_ENGINE"] == "cpu"
    assert "deploy" not in svc, f"{name} reserves a GPU"

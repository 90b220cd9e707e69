"""The monitoring files against what the service really exports: docker/grafana's dashboard, its provisioning,
docker/prometheus/prometheus.yml, the compose profile "monitoring" and the example alerts in docs/monitoring.md.

The exported series come from the service's own ``Metrics`` and ``EngineProcessMetrics`` (each in its private
registry), every recorder called once, then rendered as ``GET /metrics`` renders them and parsed back: the
names and labels of real series, not a list written here. Every PromQL expression is parsed (promql-parser)
and walked: each selector must name an exported series and match only its labels, ``rate``/``increase`` only
take counters and histogram series, and the labels each expression returns are computed through its
aggregations, binary operators and functions, so that ``by (...)``, ``on (...)`` and every ``{{label}}`` of a
legend name labels that are really there.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.api.metrics_route import router
from service.errors import ServiceError
from service.metrics import REFUSAL_REASONS, EngineProcessMetrics, Metrics
from service.runtime.phases import LoadPhases

yaml = pytest.importorskip("yaml", reason="pyyaml is needed to read the provisioning and compose files")
promql = pytest.importorskip("promql_parser", reason="promql-parser (the test extra) parses the dashboard's PromQL")

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "onnx-service.json"
DATASOURCES = DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
PROVIDERS = DOCKER / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml"
PROMETHEUS = DOCKER / "prometheus" / "prometheus.yml"
COMPOSE = DOCKER / "compose.yaml"
DOC = ROOT / "docs" / "monitoring.md"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
TARGET_LABELS = frozenset({"job", "instance"})
"""Labels Prometheus attaches to every scraped series (the scrape target's)."""
SCRAPE_SERIES = {"up": TARGET_LABELS}
"""Series Prometheus makes itself for every target."""
GRAFANA_BUILTINS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
RATE_FUNCTIONS = {"rate", "irate", "increase"}
LABEL_KEEPING_AGGREGATIONS = {"topk", "bottomk", "limitk", "limit_ratio"}


# ----------------------------------------------------------------------------- what the service exports


@dataclass(frozen=True)
class Series:
    family: str
    monotonic: bool  # a counter's _total or a histogram's _bucket/_sum/_count: what rate() may take
    labels: frozenset[str] | None  # None: the family has no sample yet (no recorder call below made one)


def _exercised_text() -> str:
    """Every recorder of both metric sets called once, rendered as ``GET /metrics`` renders them."""
    metrics = Metrics()
    metrics.observe_request("m", "v2_infer", "success", 0.01, queue_s=0.002, compute_s=0.005, protocol="grpc")
    metrics.observe_batch("m", 1, 8, 0.004)
    metrics.set_queue_depth("m", 1, 3)
    metrics.set_loaded_models(1)
    phases = LoadPhases()
    phases.add("warm", 2.5)
    metrics.observe_load("m", 1, phases)
    metrics.refused_connection(REFUSAL_REASONS[0])
    metrics.rebalanced.inc()
    engine = EngineProcessMetrics()
    engine.observe_call("m", 16)
    engine.observe_page_lock(4096)
    return metrics.render()[0].decode() + generate_latest(engine.registry).decode()


_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def _series_names(family: Any) -> set[str]:
    """The names Prometheus stores a family's series under (from its samples, or its type when it has none)."""
    if family.samples:
        return {s.name for s in family.samples}
    return {family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",))}


@pytest.fixture(scope="module")
def exported() -> dict[str, Series]:
    """Series name -> its family, kind and labels (target labels included), as Prometheus stores them."""
    out: dict[str, Series] = {}
    for family in text_string_to_metric_families(_exercised_text()):
        for name in _series_names(family):
            labels = {k for s in family.samples if s.name == name for k in s.labels}
            monotonic = family.type in _SUFFIXES and not name.endswith("_created")
            out[name] = Series(family.name, monotonic, frozenset(labels) | TARGET_LABELS if family.samples else None)
    for name, labels in SCRAPE_SERIES.items():
        out[name] = Series(name, False, labels)
    return out


def test_every_service_family_is_exported_with_samples(exported: dict[str, Series]) -> None:
    """The recorders above reach every family: a new labelled metric needs its call in ``_exercised_text``."""
    unsampled = sorted({s.family for s in exported.values() if s.labels is None})
    assert not unsampled, f"no sample of {unsampled}: call their recorder in _exercised_text"
    assert exported["service_request_duration_seconds_bucket"].labels == (
        {"model", "endpoint", "protocol", "le"} | TARGET_LABELS
    )


# ----------------------------------------------------------------------------- PromQL: names and labels


class PromQLChecker:
    """The labels a PromQL expression returns, asserting on the way that every selector, matcher, grouping
    and function argument refers to series and labels that exist. ``None`` stands for a scalar."""

    def __init__(self, exported: dict[str, Series], where: str) -> None:
        self.exported, self.where = exported, where
        self.families: set[str] = set()
        self.matched: dict[str, set[str]] = {}  # label -> the values its matchers name (alternatives split)

    def labels(self, node: Any) -> frozenset[str] | None:
        p = promql
        if isinstance(node, p.VectorSelector):
            return self._selector(node)
        if isinstance(node, p.MatrixSelector):
            return self._selector(node.vector_selector)
        if isinstance(node, p.ParenExpr | p.UnaryExpr | p.SubqueryExpr):
            return self.labels(node.expr)
        if isinstance(node, p.NumberLiteral | p.StringLiteral):
            return None
        if isinstance(node, p.AggregateExpr):
            return self._aggregate(node)
        if isinstance(node, p.BinaryExpr):
            return self._binary(node)
        if isinstance(node, p.Call):
            return self._call(node)
        raise AssertionError(f"{self.where}: unhandled PromQL node {type(node).__name__}: {node}")

    def _selector(self, node: Any) -> frozenset[str]:
        names = [m.value for m in node.matchers.matchers if m.name == "__name__"]
        name = node.name or (names[0] if names else None)
        assert name in self.exported, f"{self.where}: {name!r} is not a series the service exports"
        series = self.exported[name]
        assert series.labels is not None, f"{self.where}: {name} has no sample to read its labels from"
        self.families.add(series.family)
        for matcher in node.matchers.matchers:
            assert matcher.name == "__name__" or matcher.name in series.labels, (
                f"{self.where}: {name} has no label {matcher.name!r} (it has {sorted(series.labels)})"
            )
            self.matched.setdefault(matcher.name, set()).update(matcher.value.split("|"))
        return series.labels

    def _subset(self, wanted: list[str], have: frozenset[str] | None, what: str) -> None:
        missing = set(wanted) - (have or frozenset())
        assert not missing, f"{self.where}: {what} uses {sorted(missing)}, not among {sorted(have or ())}"

    def _aggregate(self, node: Any) -> frozenset[str]:
        inner = self.labels(node.expr)
        assert inner is not None, f"{self.where}: aggregation over a scalar: {node}"
        op, modifier = str(node.op), node.modifier
        if op in LABEL_KEEPING_AGGREGATIONS:
            return inner
        if op == "count_values":
            return frozenset({node.param.val})
        if modifier is None:
            return frozenset()
        self._subset(modifier.labels, inner, f"{op} {modifier}")
        if modifier.type == promql.AggModifierType.By:
            return frozenset(modifier.labels)
        return inner - set(modifier.labels)

    def _binary(self, node: Any) -> frozenset[str] | None:
        lhs, rhs = self.labels(node.lhs), self.labels(node.rhs)
        if lhs is None or rhs is None:
            return rhs if lhs is None else lhs
        op, modifier = str(node.op), node.modifier
        matching = modifier.matching if modifier is not None else None
        if matching is not None:
            self._subset(matching.labels, lhs, f"left side of {op} {modifier}")
            self._subset(matching.labels, rhs, f"right side of {op} {modifier}")
        if op in ("and", "or", "unless"):
            return lhs | rhs if op == "or" else lhs
        card = modifier.card if modifier is not None else promql.VectorMatchCardinality.OneToOne
        if card == promql.VectorMatchCardinality.ManyToOne:
            self._subset(modifier.group_labels or [], rhs, "group_left")
            return lhs | set(modifier.group_labels or [])
        if card == promql.VectorMatchCardinality.OneToMany:
            self._subset(modifier.group_labels or [], lhs, "group_right")
            return rhs | set(modifier.group_labels or [])
        if matching is None:  # one-to-one on all labels: both sides must carry the same ones, or nothing matches
            assert lhs == rhs, f"{self.where}: {op} matches {sorted(lhs)} against {sorted(rhs)}: {node}"
            return lhs
        if matching.type == promql.LabelModifierType.Include:
            return frozenset(matching.labels)
        return lhs - set(matching.labels)

    def _call(self, node: Any) -> frozenset[str] | None:
        name, args = node.func.name, node.args
        if name in RATE_FUNCTIONS:
            series = self.exported.get(args[0].vector_selector.name)
            assert series is None or series.monotonic, f"{self.where}: {name}() of a gauge: {node}"
        arg_labels = [self.labels(a) for a in args]
        if name == "histogram_quantile":
            self._subset(["le"], arg_labels[1], "histogram_quantile")
            return arg_labels[1] - {"le"}
        if name in ("label_replace", "label_join"):
            return arg_labels[0] | {args[1].val}
        vectors = [labels for labels in arg_labels if labels is not None]
        return vectors[0] if vectors else (frozenset() if name == "vector" else None)


_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


def _substitute(expr: str, variables: set[str], where: str) -> str:
    """Grafana's variables replaced as Grafana would before sending the query (durations for the built-in
    intervals, a regex for the dashboard's own, which only ever stand in label matchers' values)."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        assert name in variables, f"{where}: ${name} is not a variable of the dashboard"
        return ".+"

    return _VARIABLE.sub(value, expr)


def _error_codes(cls: type[ServiceError] = ServiceError) -> set[str]:
    return {cls.code}.union(*(_error_codes(sub) for sub in cls.__subclasses__()))


OUTCOMES = {"success", "disconnected"} | _error_codes()
"""What ``outcome`` can be (service.dataplane.RequestTrace.finish: success, disconnected or a ServiceError's code)."""
KNOWN_VALUES = {"outcome": OUTCOMES, "reason": set(REFUSAL_REASONS)}


def check_promql(expr: str, exported: dict[str, Series], where: str, variables: set[str] = frozenset()):
    """Parse ``expr`` (Grafana's variables substituted) and return (its result labels, the families it reads)."""
    try:
        tree = promql.parse(_substitute(expr, set(variables), where))
    except ValueError as error:
        raise AssertionError(f"{where}: PromQL does not parse: {error}\n{expr}") from error
    checker = PromQLChecker(exported, where)
    labels = checker.labels(tree)
    for label, known in KNOWN_VALUES.items():
        unknown = checker.matched.get(label, set()) - known
        assert not unknown, f"{where}: {label} is never {sorted(unknown)}"
    return labels, checker.families


def test_checker_refuses_unknown_names_labels_and_mismatched_sides(exported: dict[str, Series]) -> None:
    """The checker itself can fail: each broken expression below is refused, naming the problem."""
    broken = {
        "service_requests": "not a series",  # the counter is stored as service_requests_total
        'service_queue_depth{outcome="x"}': "no label 'outcome'",
        "sum by (reason) (rate(service_requests_total[5m]))": "uses ['reason']",
        "rate(service_queue_depth[5m])": "of a gauge",
        "histogram_quantile(0.9, sum by (model) (rate(service_batch_size_bucket[5m])))": "uses ['le']",
        "sum by (model) (rate(service_requests_total[5m])) / sum(rate(service_requests_total[5m]))": "matches",
        "sum(rate(service_requests_total[5m])": "does not parse",
        'service_requests_total{outcome=~"timeout|error"}': "outcome is never ['error']",
    }
    for expr, message in broken.items():
        with pytest.raises(AssertionError, match=re.escape(message)):
            check_promql(expr, exported, "probe")
    labels, families = check_promql(
        'histogram_quantile(0.5, sum by (le, model) (rate(service_request_duration_seconds_bucket{job=~"$j"}[5m])))',
        exported, "probe", {"j"},
    )
    assert labels == {"model"} and families == {"service_request_duration_seconds"}


# ----------------------------------------------------------------------------- the dashboard


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows too."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def test_dashboard_header_and_variables(dashboard: dict) -> None:
    assert dashboard["schemaVersion"] >= 39
    assert dashboard["uid"] and dashboard["title"]
    variables = _variables(dashboard)
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("job", "model"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"] == DATASOURCE
        assert variables[name]["definition"].startswith("label_values(")
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids repeat"


def test_every_panel_reads_the_templated_datasource(dashboard: dict) -> None:
    panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    assert len(panels) >= 10
    for panel in panels:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, f"{panel['title']} {target['refId']}"
        assert panel["gridPos"]["x"] >= 0 and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]


def test_panel_queries_use_exported_series_and_labels(dashboard: dict, exported: dict[str, Series]) -> None:
    variables = set(_variables(dashboard))
    used: set[str] = set()
    for panel in (p for p in _panels(dashboard) if p["type"] != "row"):
        for target in panel["targets"]:
            where = f"panel {panel['title']!r} {target['refId']}"
            labels, families = check_promql(target["expr"], exported, where, variables)
            used |= families
            legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            missing = legend_labels - (labels or frozenset())
            assert not missing, f"{where}: the legend names {sorted(missing)}; the query returns {sorted(labels or ())}"
            assert "[$__rate_interval]" in target["expr"] or not re.search(r"\[\w+\]", target["expr"]), (
                f"{where}: a fixed range; use $__rate_interval"
            )
    families = {s.family for s in exported.values() if not s.family.endswith("_created")}
    assert families - used == set(), "exported families that no panel shows"


def test_variable_queries_use_exported_series_and_labels(dashboard: dict, exported: dict[str, Series]) -> None:
    names = set(_variables(dashboard))
    for name, variable in _variables(dashboard).items():
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
        assert match, f"${name}: {variable['definition']}"
        assert variable["query"]["query"] == variable["definition"]
        labels, _ = check_promql(match.group(1), exported, f"${name}", names - {name})
        assert match.group(2) in labels, f"${name}: {match.group(1)} has no label {match.group(2)}"


# ----------------------------------------------------------------------------- provisioning and compose


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _default(value: str) -> str:
    """Compose's ${VAR:-default} with nothing set: the default."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def _host_path(service: dict, container_path: str) -> Path:
    """Where a path inside ``service``'s container comes from on the host (its bind mounts, compose-relative)."""
    wanted = PurePosixPath(container_path)
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith(".") and (wanted == PurePosixPath(target) or PurePosixPath(target) in wanted.parents):
            return (COMPOSE.parent / source / wanted.relative_to(target)).resolve()
    raise AssertionError(f"{container_path} is not bind-mounted from the repository")


def _container_port(service: dict) -> int:
    """The container port of the service's first published port (REST for the model servers)."""
    return int(_default(service["ports"][0]).rsplit(":", 1)[1])


def test_monitoring_services_are_a_pinned_loopback_profile(compose: dict) -> None:
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        svc = services[name]
        assert svc["profiles"] == ["monitoring"], name
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", svc["image"]), f"{name}: pin a release tag: {svc['image']}"
        for port in svc["ports"]:
            assert _default(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    assert _default(services["grafana"]["ports"][0]) == "127.0.0.1:3000:3000"
    env = services["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert str(env["GF_SECURITY_ADMIN_PASSWORD"]).startswith("${"), "no literal password in the file"
    for volume in (v.split(":")[0] for name in ("prometheus", "grafana") for v in services[name]["volumes"]):
        assert volume.startswith(".") or volume in compose["volumes"], volume


def test_prometheus_scrapes_the_model_servers_on_their_port(compose: dict) -> None:
    services = compose["services"]
    prometheus = services["prometheus"]
    config_flag = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    config = yaml.safe_load(_host_path(prometheus, config_flag.split("=", 1)[1]).read_text())
    assert _host_path(prometheus, config_flag.split("=", 1)[1]) == PROMETHEUS.resolve()
    (job,) = config["scrape_configs"]
    assert job.get("metrics_path", "/metrics") in {route.path for route in router.routes}
    targets = [(name, sd["port"]) for sd in job["dns_sd_configs"] for name in sd["names"]]
    targets += [tuple(t.rsplit(":", 1)) for sc in job.get("static_configs", []) for t in sc["targets"]]
    servers = {name for name, svc in services.items() if "build" in svc}
    assert {name for name, _ in targets} == servers, "every model server scraped, and nothing else"
    for name, port in targets:
        served = _container_port(services[name])
        assert int(port) == served, f"{name} serves /metrics on port {served}, not {port}"


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard(compose: dict) -> None:
    services = compose["services"]
    grafana = services["grafana"]
    assert _host_path(grafana, "/etc/grafana/provisioning/datasources") == DATASOURCES.parent.resolve()
    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert source["type"] == "prometheus"
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", source["url"]).groups()
    assert host == "prometheus" and int(port) == _container_port(services["prometheus"])
    assert _host_path(grafana, "/etc/grafana/provisioning/dashboards") == PROVIDERS.parent.resolve()
    (provider,) = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file"
    folder = _host_path(grafana, provider["options"]["path"])
    assert folder == DASHBOARD.parent.resolve() and DASHBOARD.exists()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert _host_path(grafana, home) == DASHBOARD.resolve()


# ----------------------------------------------------------------------------- docs/monitoring.md


def test_doc_names_every_family_and_its_alerts_are_valid(exported: dict[str, Series]) -> None:
    text = DOC.read_text()
    for family in {s.family for s in exported.values() if s.family.startswith("service_")}:
        if not family.endswith("_created"):
            assert f"`{family}" in text, f"docs/monitoring.md does not describe {family}"
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "groups:" in b]
    assert len(blocks) == 1, "one block of Prometheus alerting rules expected"
    rules = [rule for group in blocks[0]["groups"] for rule in group["rules"]]
    assert len(rules) >= 4
    for rule in rules:
        assert rule["alert"] and rule["labels"]["severity"] and rule["annotations"]["summary"], rule
        labels, _ = check_promql(rule["expr"], exported, f"alert {rule['alert']}")
        placeholders = set(re.findall(r"\$labels\.(\w+)", json.dumps(rule["annotations"])))
        assert placeholders <= (labels or frozenset()), f"alert {rule['alert']}: {placeholders} not in {labels}"

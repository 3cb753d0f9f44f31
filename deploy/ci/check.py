#!/usr/bin/env python3
"""Validates deploy/: Kubernetes manifests, Collector configuration, metric catalogue, dashboard.

Run it through deploy/ci/run.sh (which `cargo xtask test` calls): that script installs the
validators below into .tools/deploy-check and passes their paths here.

  yamllint             (PyPI)   syntax and style of every deploy/*.yaml
  kubectl kustomize    (Debian kubernetes-client) renders deploy/kustomization.yaml
  kubernetes-validate  (PyPI)   the rendered objects against the Kubernetes OpenAPI schemas,
                                strict (an unknown field is an error), for the oldest and the
                                newest Kubernetes this deployment supports
  check-jsonschema     (PyPI)   otel-collector.yaml against deploy/ci/otelcol-config.schema.json
  promql-parser        (PyPI)   every PromQL expression of the dashboard, to an AST: metric and
                                label names checked against deploy/metrics.yaml
  promtool             (Debian prometheus) Prometheus's own parser on the same expressions, then
                                its rule-test engine evaluates them over synthetic series of
                                every catalogued metric: each must return data, every label its
                                legend shows must be there, and the PCIe capacity must be right
  tsc + @grafana/schema (npm)   the dashboard type-checked against Grafana's published schema

plus this file's own rules: the pods' privileges (policy_errors) and the references between the
files (ports, pipelines, metric names). `--self-test` breaks copies of the files in known ways
and fails unless every break is caught.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import promql_parser
import yaml

ROOT = Path(__file__).resolve().parents[2]
CI = Path(__file__).resolve().parent

# Kubernetes versions the manifests must be valid for: securityContext.appArmorProfile is 1.30+.
K8S_VERSIONS = ["1.30.0", "1.37.0"]

# The capabilities the agent may add, and why (deploy/README.md says more). Anything else,
# SYS_ADMIN first of all, is a policy failure.
AGENT_CAPS = {"BPF", "PERFMON", "SYS_PTRACE", "DAC_READ_SEARCH"}
# hostPath volumes the agent must mount: path -> must be read-only.
AGENT_HOST_PATHS = {"/sys/kernel/btf": True, "/sys/fs/bpf": False, "/sys/kernel/tracing": False,
                    "/var/log/containers": True}

PANEL_TYPES = {"row", "timeseries", "stat", "table", "bargauge"}
GRAFANA_BUILTINS = {"__rate_interval": "2m", "__interval": "1m", "__range": "10m"}


class Failures:
    def __init__(self):
        self.items = []

    def add(self, stage, msg):
        self.items.append(f"[{stage}] {msg}")

    def __bool__(self):
        return bool(self.items)


def run(cmd, **kw):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


# ----------------------------------------------------------------------------------- metrics

UNIT_MAP = {"d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds",
            "us": "microseconds", "ns": "nanoseconds", "By": "bytes", "KiBy": "kibibytes",
            "MiBy": "mebibytes", "GiBy": "gibibytes", "TiBy": "tibibytes", "KBy": "kilobytes",
            "MBy": "megabytes", "GBy": "gigabytes", "TBy": "terabytes", "m": "meters",
            "V": "volts", "A": "amperes", "J": "joules", "W": "watts", "g": "grams",
            "Cel": "celsius", "Hz": "hertz", "1": "", "%": "percent"}
PER_UNIT_MAP = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week", "mo": "month",
                "y": "year"}


def tokens(s):
    return [t for t in re.split(r"[^A-Za-z0-9]+", s) if t]


def prom_metric_name(otel, kind, unit):
    """The name the Collector's prometheus exporter gives an OTLP metric with its default
    translation (UnderscoreEscapingWithSuffixes): the rules of the Prometheus otlptranslator's
    MetricNamer with suffixes on and UTF-8 off."""
    toks = tokens(otel)
    main, _, per = unit.partition("/")
    main, per = main.strip(), per.strip()
    main_suffix = "_".join(tokens(UNIT_MAP.get(main, main))) if main and "{" not in main and "}" not in main else ""
    per_suffix = ""
    if per and "{" not in per and "}" not in per:
        p = "_".join(tokens(PER_UNIT_MAP.get(per, per)))
        per_suffix = f"per_{p}" if p else ""
    if main_suffix and main_suffix not in toks:
        toks.append(main_suffix)
    if per_suffix and per_suffix not in toks:
        toks.append(per_suffix)
    if kind == "counter":
        toks = [t for t in toks if t != "total"] + ["total"]
    if unit == "1" and kind == "gauge":
        toks = [t for t in toks if t != "ratio"] + ["ratio"]
    name = "_".join(toks)
    return "_" + name if name[:1].isdigit() else name


def prom_label_name(key):
    name = re.sub(r"[^A-Za-z0-9_]", "_", key)
    return "key_" + name if name[:1].isdigit() else name


def load_catalogue(deploy, fail):
    """deploy/metrics.yaml -> {prometheus series name: {labels: set, values: {label: [..]},
    kind, base}}; also checks each listed name against the translation rules."""
    cat = yaml.safe_load((deploy / "metrics.yaml").read_text())
    groups = cat.get("groups", {})
    common = [prom_label_name(a) for a in cat["resource_attributes"]] + cat["exporter_labels"]
    series = {}
    for m in cat["metrics"]:
        want = prom_metric_name(m["otel"], m["type"], str(m["unit"]))
        if m["prometheus"] != want:
            fail.add("metrics", f"{m['otel']} ({m['type']}, unit {m['unit']!r}) is exported to "
                                f"Prometheus as {want}, not {m['prometheus']}")
        attrs = []
        for a in m["attributes"]:
            attrs += groups.get(a, [a])
        labels = {prom_label_name(a) for a in attrs} | set(common)
        values = {prom_label_name(k): v for k, v in (m.get("values") or {}).items()}
        entry = {"labels": labels, "values": values, "kind": m["type"], "base": m["prometheus"],
                 "otel": m["otel"]}
        if m["type"] == "histogram":
            series[m["prometheus"] + "_bucket"] = {**entry, "labels": labels | {"le"}}
            series[m["prometheus"] + "_sum"] = entry
            series[m["prometheus"] + "_count"] = entry
        elif m["type"] in ("gauge", "counter"):
            series[m["prometheus"]] = entry
        else:
            fail.add("metrics", f"{m['otel']}: unknown type {m['type']!r}")
    readme = (deploy / "README.md").read_text() if (deploy / "README.md").exists() else ""
    for m in cat["metrics"]:
        if f"`{m['prometheus']}`" not in readme:
            fail.add("metrics", f"deploy/README.md does not list `{m['prometheus']}`")
    return series


# ------------------------------------------------------------------------------- manifests

def containers_of(obj):
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return spec, spec.get("containers", []) + spec.get("initContainers", [])


def policy_errors(objs):
    """The project's rules for the pods, beyond what the API schema says."""
    errs = []
    agent = None
    for o in objs:
        if o.get("kind") not in ("DaemonSet", "Deployment", "StatefulSet"):
            continue
        name = o["metadata"]["name"]
        spec, ctrs = containers_of(o)
        if spec.get("hostNetwork") or spec.get("hostIPC"):
            errs.append(f"{name}: hostNetwork/hostIPC are not needed and not allowed")
        for c in ctrs:
            where = f"{name}/{c['name']}"
            sc = c.get("securityContext") or {}
            if sc.get("privileged") is not False:
                errs.append(f"{where}: securityContext.privileged must be set to false")
            if sc.get("allowPrivilegeEscalation") is not False:
                errs.append(f"{where}: securityContext.allowPrivilegeEscalation must be false")
            if sc.get("readOnlyRootFilesystem") is not True:
                errs.append(f"{where}: securityContext.readOnlyRootFilesystem must be true")
            caps = sc.get("capabilities") or {}
            if caps.get("drop") != ["ALL"]:
                errs.append(f"{where}: capabilities.drop must be [ALL]")
            added = set(caps.get("add") or [])
            allowed = AGENT_CAPS if name == "gpu-observer" else set()
            if added - allowed:
                errs.append(f"{where}: capabilities {sorted(added - allowed)} are not allowed "
                            f"(allowed: {sorted(allowed) or 'none'})")
            if ((sc.get("seccompProfile") or {}).get("type")) != "RuntimeDefault":
                errs.append(f"{where}: seccompProfile.type must be RuntimeDefault")
            image = c.get("image", "")
            if ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest"):
                errs.append(f"{where}: image {image!r} must have a fixed tag")
            res = c.get("resources") or {}
            for k in ("requests", "limits"):
                if not {"cpu", "memory"} <= set((res.get(k) or {})):
                    errs.append(f"{where}: resources.{k} must set cpu and memory")
        if name == "gpu-observer":
            agent = o
    if agent is None:
        return errs + ["no DaemonSet named gpu-observer"]
    spec, ctrs = containers_of(agent)
    if spec.get("hostPID") is not True:
        errs.append("gpu-observer: hostPID must be true (the agent reads every process's /proc)")
    if set(AGENT_CAPS) - set(ctrs[0]["securityContext"]["capabilities"].get("add") or []):
        errs.append(f"gpu-observer: needs capabilities {sorted(AGENT_CAPS)}")
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = {m["name"]: m for m in ctrs[0].get("volumeMounts", [])}
    for path, ro in AGENT_HOST_PATHS.items():
        found = [n for n, v in vols.items() if (v.get("hostPath") or {}).get("path") == path]
        if not found or found[0] not in mounts:
            errs.append(f"gpu-observer: host path {path} is not mounted")
        elif bool(mounts[found[0]].get("readOnly")) != ro:
            errs.append(f"gpu-observer: {path} must be mounted {'read-only' if ro else 'read-write'}")
    env = {e["name"]: e for e in ctrs[0].get("env", [])}
    if (env.get("K8S_NODE_NAME", {}).get("valueFrom", {}).get("fieldRef", {})
            .get("fieldPath")) != "spec.nodeName":
        errs.append("gpu-observer: env K8S_NODE_NAME must come from fieldRef spec.nodeName")
    return errs


def check_manifests(deploy, tools, work, fail):
    out = run([tools["kubectl"], "kustomize", deploy])
    if out.returncode != 0:
        fail.add("kustomize", out.stderr.strip())
        return []
    rendered = work / "rendered.yaml"
    rendered.write_text(out.stdout)
    for v in K8S_VERSIONS:
        r = run([tools["kubernetes-validate"], "--strict", "--quiet", "-k", v, rendered])
        if r.returncode != 0:
            fail.add(f"kubernetes {v}", (r.stdout + r.stderr).strip())
    objs = [o for o in yaml.safe_load_all(out.stdout) if o]
    for e in policy_errors(objs):
        fail.add("policy", e)
    return objs


# ------------------------------------------------------------------------------- collector

def check_collector(deploy, tools, objs, fail):
    path = deploy / "otel-collector.yaml"
    r = run([tools["check-jsonschema"], "--schemafile", CI / "otelcol-config.schema.json", path])
    if r.returncode != 0:
        fail.add("collector schema", (r.stdout + r.stderr).strip())
    conf = yaml.safe_load(path.read_text())
    svc = conf.get("service", {})
    used = {"receivers": set(), "processors": set(), "exporters": set(),
            "extensions": set(svc.get("extensions", []))}
    for pname, p in (svc.get("pipelines") or {}).items():
        for kind in ("receivers", "processors", "exporters"):
            for c in p.get(kind, []):
                used[kind].add(c)
                if c not in (conf.get(kind) or {}):
                    fail.add("collector", f"pipeline {pname} uses {kind[:-1]} {c!r}, which is not defined")
        procs = p.get("processors", [])
        if procs and procs[0] != "memory_limiter":
            fail.add("collector", f"pipeline {pname}: memory_limiter must be the first processor")
        if procs and procs[-1] != "batch":
            fail.add("collector", f"pipeline {pname}: batch must be the last processor")
    for kind in used:
        for c in (conf.get(kind) or {}):
            if c not in used[kind]:
                fail.add("collector", f"{kind[:-1]} {c!r} is defined but used by no pipeline")
    for name, exp in (conf.get("exporters") or {}).items():
        if name.split("/")[0] == "prometheus":
            exp = exp or {}
            if exp.get("add_metric_suffixes") is False or exp.get("translation_strategy") not in (
                    None, "UnderscoreEscapingWithSuffixes"):
                fail.add("collector", f"exporter {name}: the names in deploy/metrics.yaml assume the "
                                      "default translation (UnderscoreEscapingWithSuffixes)")
            if (exp.get("resource_to_telemetry_conversion") or {}).get("enabled"):
                fail.add("collector", f"exporter {name}: resource_to_telemetry_conversion would let "
                                      "resource attributes overwrite data-point attributes")
    # Ports: the agent sends to HOST_IP:<port> = the Collector's hostPort = the OTLP gRPC receiver.
    grpc = (((conf.get("receivers") or {}).get("otlp") or {}).get("protocols") or {}).get("grpc") or {}
    recv_port = str(grpc.get("endpoint", "")).rsplit(":", 1)[-1]
    coll = next((o for o in objs if o.get("kind") == "DaemonSet"
                 and o["metadata"]["name"] == "otel-collector"), None)
    agent = next((o for o in objs if o.get("kind") == "DaemonSet"
                  and o["metadata"]["name"] == "gpu-observer"), None)
    if coll is None or agent is None:
        fail.add("collector", "kustomization must render the gpu-observer and otel-collector DaemonSets")
        return
    host_ports = {str(p.get("hostPort")): str(p["containerPort"])
                  for p in coll["spec"]["template"]["spec"]["containers"][0].get("ports", [])
                  if p.get("hostPort")}
    args = agent["spec"]["template"]["spec"]["containers"][0].get("args", [])
    endpoint = args[args.index("--otlp-endpoint") + 1] if "--otlp-endpoint" in args else ""
    m = re.fullmatch(r"https?://\$\(HOST_IP\):(\d+)", endpoint)
    if not m:
        fail.add("collector", f"agent --otlp-endpoint {endpoint!r} must be http://$(HOST_IP):PORT")
    elif host_ports.get(m.group(1)) != recv_port:
        fail.add("collector", f"agent sends to host port {m.group(1)}, but the Collector maps host "
                              f"ports {host_ports} and its OTLP gRPC receiver listens on {recv_port}")
    cfg_vol = [v for v in coll["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    cms = [o["metadata"]["name"] for o in objs if o.get("kind") == "ConfigMap"
           and "otel-collector.yaml" in o.get("data", {})]
    if not cfg_vol or cfg_vol[0]["configMap"]["name"] not in cms:
        fail.add("collector", "the Collector's config volume does not name the generated ConfigMap")


# ------------------------------------------------------------------------------- dashboard

VAR_RE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


def substitute(expr, variables, where, fail):
    def repl(m):
        name = m.group(1) or m.group(2)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        if name in variables:
            return ".*"
        fail.add("dashboard", f"{where}: unknown variable ${name}")
        return ".*"
    return VAR_RE.sub(repl, expr)


def promql_names(expr, where, series, fail):
    """Parses with promql-parser; checks metric names and label names against the catalogue."""
    try:
        ast = promql_parser.parse(expr)
    except Exception as e:  # the parser raises ValueError with Prometheus's message
        fail.add("promql", f"{where}: {e}\n    {expr}")
        return
    all_labels = set().union(*(s["labels"] for s in series.values())) if series else set()

    def visit(n):
        if isinstance(n, promql_parser.VectorSelector):
            names = [m.value for m in n.matchers.matchers if m.name == "__name__"]
            metric = n.name or (names[0] if names else None)
            if metric not in series:
                fail.add("promql", f"{where}: metric {metric!r} is not in deploy/metrics.yaml")
                return
            for m in n.matchers.matchers:
                if m.name != "__name__" and m.name not in series[metric]["labels"]:
                    fail.add("promql", f"{where}: {metric} has no label {m.name!r}")
                for v in unknown_values(m, series[metric]["values"].get(m.name)):
                    fail.add("promql", f"{where}: {metric}{{{m.name}}} has no value {v!r} "
                                       f"(deploy/metrics.yaml: {series[metric]['values'][m.name]})")
        elif isinstance(n, promql_parser.AggregateExpr) and n.modifier:
            for label in n.modifier.labels:
                if label not in all_labels:
                    fail.add("promql", f"{where}: aggregation by unknown label {label!r}")
        elif isinstance(n, promql_parser.BinaryExpr) and n.modifier:
            labels = list(n.modifier.matching.labels if n.modifier.matching else [])
            labels += list(n.modifier.group_labels or [])
            for label in labels:
                if label not in all_labels:
                    fail.add("promql", f"{where}: vector matching on unknown label {label!r}")
    promql_parser.walk(ast, visit)


def unknown_values(matcher, values):
    """The values a matcher names that an enumerated label (metrics.yaml `values`) never has: an
    exact match, or each branch of a regex that is a plain alternation (a|b). A typo there would
    match nothing, or, in an alternation, silently drop one class."""
    if not values:
        return []
    if matcher.op in (promql_parser.MatchOp.Equal, promql_parser.MatchOp.NotEqual):
        names = [matcher.value]
    elif re.fullmatch(r"[A-Za-z0-9_.\-]+(\|[A-Za-z0-9_.\-]+)*", matcher.value):
        names = matcher.value.split("|")
    else:
        return []
    return [v for v in names if v and v not in values]


def layout_errors(panels):
    errs, cells = [], {}
    for p in panels:
        g = p.get("gridPos") or {}
        if not {"x", "y", "w", "h"} <= set(g):
            errs.append(f"panel {p.get('id')} {p.get('title')!r}: gridPos needs x, y, w, h")
            continue
        if g["x"] < 0 or g["w"] < 1 or g["x"] + g["w"] > 24:
            errs.append(f"panel {p['id']} {p['title']!r}: gridPos is outside the 24 columns")
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                if (x, y) in cells:
                    errs.append(f"panel {p['id']} {p['title']!r} overlaps panel {cells[(x, y)]}")
                    break
                cells[(x, y)] = p["id"]
            else:
                continue
            break
    return errs


def dashboard_queries(dash, series, fail):
    """Static checks; returns [(where, panel, target, expr with variables substituted)]."""
    panels = dash.get("panels", [])
    for e in layout_errors(panels):
        fail.add("dashboard", e)
    ids = [p.get("id") for p in panels]
    if len(ids) != len(set(ids)):
        fail.add("dashboard", f"panel ids are not unique: {ids}")
    variables = {v["name"]: v for v in dash.get("templating", {}).get("list", [])}
    ds_vars = [n for n, v in variables.items() if v["type"] == "datasource"]
    if ds_vars != ["datasource"] or variables["datasource"].get("query") != "prometheus":
        fail.add("dashboard", "needs exactly one data source variable, `datasource`, of type prometheus")
    for name, v in variables.items():
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v.get("query", ""))
        if not m:
            fail.add("dashboard", f"variable {name}: query must be label_values(SELECTOR, LABEL)")
            continue
        where = f"variable {name}"
        sel = substitute(m.group(1), variables, where, fail)
        promql_names(sel, where, series, fail)
        metric = sel.split("{")[0].strip()
        if metric in series and m.group(2) not in series[metric]["labels"]:
            fail.add("dashboard", f"{where}: {metric} has no label {m.group(2)!r}")
    queries = []
    for p in panels:
        if p.get("type") not in PANEL_TYPES:
            fail.add("dashboard", f"panel {p.get('id')}: type {p.get('type')!r} is not one of {sorted(PANEL_TYPES)}")
        if p.get("type") == "row":
            continue
        if (p.get("datasource") or {}).get("uid") != "${datasource}":
            fail.add("dashboard", f"panel {p['id']} {p['title']!r}: datasource must be ${{datasource}}")
        targets = p.get("targets") or []
        if not targets:
            fail.add("dashboard", f"panel {p['id']} {p['title']!r}: no queries")
        refs = [t.get("refId") for t in targets]
        if len(refs) != len(set(refs)):
            fail.add("dashboard", f"panel {p['id']} {p['title']!r}: refIds are not unique")
        for t in targets:
            where = f"panel {p['id']} {p['title']!r} query {t.get('refId')}"
            if not t.get("expr"):
                fail.add("dashboard", f"{where}: no expr")
                continue
            expr = substitute(t["expr"], variables, where, fail)
            promql_names(expr, where, series, fail)
            queries.append((where, p, t, expr))
    return queries


# The Grafana schema check: the dashboard and each panel, as TypeScript values, must satisfy the
# types @grafana/schema publishes (string enums widened to their values, which is what JSON has).
TS_PANEL_TYPES = {
    "timeseries": ("TimeSeries", "timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen"),
    "stat": ("Stat", "stat/panelcfg/x/StatPanelCfg_types.gen"),  # no custom field config
    "table": ("Table", "table/panelcfg/x/TablePanelCfg_types.gen"),
    "bargauge": ("BarGauge", "bargauge/panelcfg/x/BarGaugePanelCfg_types.gen"),  # no custom field config
}


def check_dashboard_types(dash, tools, work, fail):
    lines = ["import type * as S from '@grafana/schema';"]
    for alias, mod in TS_PANEL_TYPES.values():
        lines.append(f"import type * as {alias} from '@grafana/schema/dist/esm/raw/composable/{mod}';")
    lines += [
        "type Lit<T> = T extends string ? `${T}` : T extends number | boolean | null | undefined ? T",
        "  : T extends Array<infer U> ? Array<Lit<U>> : T extends object ? { [K in keyof T]: Lit<T[K]> } : T;",
        "type PanelOf<O, F> = Lit<Omit<S.Panel<O, F>, 'options' | 'type'>> & { type: string; options: Lit<O> };",
        "type DashboardTop = Lit<Omit<S.Dashboard, 'panels'>>;",
    ]
    top = {k: v for k, v in dash.items() if k != "panels"}
    lines.append(f"export const dashboard = {json.dumps(top, indent=2, ensure_ascii=False)} satisfies DashboardTop;")
    for p in dash.get("panels", []):
        slug = re.sub(r"\W+", "_", p.get("title", "")).strip("_").lower()
        var = f"panel_{p.get('id')}_{slug}"
        body = json.dumps(p, indent=2, ensure_ascii=False)
        if p.get("type") == "row":
            lines.append(f"export const {var} = {body} satisfies Lit<S.RowPanel>;")
        elif p.get("type") in TS_PANEL_TYPES:
            alias = TS_PANEL_TYPES[p["type"]][0]
            field_config = ("Record<string, unknown>" if p["type"] in ("stat", "bargauge")
                            else f"{alias}.FieldConfig")
            lines.append(f"export const {var} = {body} satisfies PanelOf<{alias}.Options, {field_config}>;")
    src = tools["node_modules"].parent / "work" / "dashboard.ts"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text("\n".join(lines) + "\n")
    r = run([tools["node"], tools["node_modules"] / "typescript/bin/tsc", "--noEmit", "--strict",
             "--target", "es2022", "--module", "esnext", "--moduleResolution", "bundler",
             "--skipLibCheck", "--pretty", "false", src])
    if r.returncode != 0:
        out = (r.stdout + r.stderr).strip().replace(str(src), "dashboard.ts")
        fail.add("grafana schema", f"{out}\n    (the TypeScript rendering of the dashboard is {src})")


# ------------------------------------------------------------------------------- promtool

SYNTH_NODES = ["node-a", "node-b"]
SYNTH_PODS = [("ml", "train-0", 101), ("serving", "infer-0", 202)]
SYNTH_GPUS = [("0", 4, 16), ("1", 1, 8)]       # index, PCIe generation, lanes
LE = ["0.0001", "0.001", "0.01", "0.1", "1", "+Inf"]
GAUGE_VALUE = {"hw_gpu_memory_usage_bytes": 2e10, "hw_gpu_memory_limit_bytes": 8e10,
               "hw_power_watts": 300, "hw_temperature_celsius": 60,
               "gpu_cuda_memory_outstanding_bytes": 1e9}
# gpu_cuda_time_seconds_total: each pod holds a context on each GPU all the time (60 s a minute),
# split over the bottleneck classes in these seconds a minute; the queries that compute GPU-hours,
# GPUs held or the share of each class are checked against them (check_promtool).
GPU_TIME = "gpu_cuda_time_seconds_total"
SYNTH_CLASS_SECONDS = {"gpu_bound": 24, "idle": 12, "launch_bound": 9, "sync_bound": 6,
                       "transfer_bound": 3, "host_bound": 3, "mixed": 3}
# Panel unit of a gpu_cuda_time query with legend {{gpu_bottleneck}} -> its value for a class, from
# that class's synthetic seconds a minute: share of the time, GPU-hours over $__range, GPUs held.
RANGE_MINUTES = int(GRAFANA_BUILTINS["__range"].removesuffix("m"))
GPU_TIME_UNITS = {
    "percentunit": ("share of GPU time", lambda sec, n: sec / 60),
    "suffix: GPU-h": ("GPU-hours over the range",
                      lambda sec, n: n * sec * RANGE_MINUTES / 3600),
    "suffix: GPUs": ("GPUs held", lambda sec, n: n * sec / 60),
}


def lane_rate(gen):
    return 0.98462e9 * 2 ** (gen - 3) if gen >= 3 else 0.25e9 * 2 ** (gen - 1)


def synthetic_series(series):
    """promtool input_series: every catalogued series, on two nodes, two GPUs, two pods."""
    out = []

    def fmt(name, labels):
        return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"

    for name, s in sorted(series.items()):
        base_labels = [{}]
        for label in sorted(s["labels"]):
            vals = s["values"].get(label)
            if vals:
                base_labels = [{**b, label: v} for b in base_labels for v in vals]
        combos = []
        for node in SYNTH_NODES:
            # Per GPU (NVML), per process or pod (CUDA), or both (gpu_cuda_time: per pod and GPU).
            gpus = [({"hw_id": f"GPU-{node}-{idx}", "hw_name": "NVIDIA H100", "gpu_index": idx},
                     (gen, width)) for idx, gen, width in SYNTH_GPUS] \
                if "hw_id" in s["labels"] else [({}, None)]
            pods = [{"k8s_namespace_name": ns, "k8s_pod_name": pod, "k8s_container_name": "main",
                     "container_id": f"c{pid}", "process_pid": str(pid),
                     "process_executable_name": "python", "process_command_line": "python train.py"}
                    for ns, pod, pid in SYNTH_PODS] \
                if "k8s_pod_name" in s["labels"] else [{}]
            for b in base_labels:
                b = {**b, "k8s_node_name": node, "host_name": node, "job": "gpu-observer",
                     "instance": f"gpu-observer-{node}", "otel_scope_name": "gpu-observer"}
                for gpu_labels, link in gpus:
                    for pod_labels in pods:
                        combos.append(({**b, **gpu_labels, **pod_labels}, link))
        for labels, gpu in combos:
            labels = {k: v for k, v in labels.items() if k in s["labels"] or k == "otel_scope_name"}
            if name.endswith("_bucket"):
                for i, le in enumerate(LE):
                    out.append({"series": fmt(name, {**labels, "le": le}), "values": f"0+{(i + 1) * 10}x30"})
            elif name == GPU_TIME:
                out.append({"series": fmt(name, labels),
                            "values": f"0+{SYNTH_CLASS_SECONDS[labels['gpu_bottleneck']]}x30"})
            elif s["kind"] in ("counter", "histogram"):
                out.append({"series": fmt(name, labels), "values": "0+600x30"})
            elif name.startswith("hw_gpu_pcie_link_generation"):
                out.append({"series": fmt(name, labels), "values": f"{gpu[0]}x30"})
            elif name == "hw_gpu_pcie_link_width":
                out.append({"series": fmt(name, labels), "values": f"{gpu[1]}x30"})
            else:
                out.append({"series": fmt(name, labels), "values": f"{GAUGE_VALUE.get(name, 0.5)}x30"})
    return out


def by_labels(expr):
    """The labels of every `by (...)` aggregation in expr."""
    labels = set()
    try:
        ast = promql_parser.parse(expr)
    except Exception:  # reported by promql_names
        return labels

    def visit(n):
        if (isinstance(n, promql_parser.AggregateExpr) and n.modifier
                and n.modifier.type == promql_parser.AggModifierType.By):
            labels.update(n.modifier.labels)
    promql_parser.walk(ast, visit)
    return labels


def check_promtool(queries, series, tools, work, fail):
    rules, tests = [], []
    legend_re = re.compile(r"\{\{\s*(\w+)\s*\}\}")
    capacity_queries = 0
    gpu_time_checked = {unit: 0 for unit in GPU_TIME_UNITS}
    classes = (series.get(GPU_TIME) or {}).get("values", {}).get("gpu_bottleneck")
    if classes is not None and set(classes) != set(SYNTH_CLASS_SECONDS):
        fail.add("metrics", f"{GPU_TIME}: the classes in deploy/metrics.yaml {sorted(classes)} are not "
                            f"those check.py has synthetic time for {sorted(SYNTH_CLASS_SECONDS)}")
        return
    gpu_time_series = len(SYNTH_NODES) * len(SYNTH_GPUS) * len(SYNTH_PODS)
    for i, (where, p, t, expr) in enumerate(queries):
        rec = f"dashboard:q{i}"
        rules.append({"record": rec, "expr": expr})
        tag = f"  # {where}"
        tests.append({"expr": f"(count({rec}) > bool 0) or vector(0){tag}", "eval_time": "20m",
                      "exp_samples": [{"labels": "{}", "value": 1}]})
        for label in legend_re.findall(t.get("legendFormat", "")):
            tests.append({"expr": f'count({rec}{{{label}=""}}) or vector(0){tag}: legend label {label}',
                          "eval_time": "20m", "exp_samples": [{"labels": "{}", "value": 0}]})
        if t.get("format") == "table":
            # A table shows the labels its query groups by, as columns: each must be on the result.
            for label in sorted(by_labels(expr) - {"le"}):
                tests.append({"expr": f'count({rec}{{{label}=""}}) or vector(0){tag}: table column {label}',
                              "eval_time": "20m", "exp_samples": [{"labels": "{}", "value": 0}]})
        unit = ((p.get("fieldConfig") or {}).get("defaults") or {}).get("unit")
        if GPU_TIME in expr and t.get("legendFormat") == "{{gpu_bottleneck}}" and unit in GPU_TIME_UNITS:
            what, value = GPU_TIME_UNITS[unit]
            gpu_time_checked[unit] += 1
            # One series per class, each within 1e-9 (relative) of its value: promtool compares
            # samples exactly, and sums of rates are not.
            tests.append({"expr": f"count({rec}){tag}: one series per bottleneck class", "eval_time": "20m",
                          "exp_samples": [{"labels": "{}", "value": len(SYNTH_CLASS_SECONDS)}]})
            for c, sec in SYNTH_CLASS_SECONDS.items():
                want = value(sec, gpu_time_series)
                tests.append({"expr": f'abs({rec}{{gpu_bottleneck="{c}"}} - {want!r}) < bool {want * 1e-9!r}'
                                      f"{tag}: {what} of {c} = {want:g}",
                              "eval_time": "20m", "exp_samples": [{"labels": f'{{gpu_bottleneck="{c}"}}', "value": 1}]})
        if "link capacity" in t.get("legendFormat", ""):
            capacity_queries += 1
            samples = []
            for node in SYNTH_NODES:
                for idx, gen, width in SYNTH_GPUS:
                    samples.append({"labels": f'{rec}{{gpu_index="{idx}",hw_id="GPU-{node}-{idx}",k8s_node_name="{node}"}}',
                                    "value": width * lane_rate(gen)})
            tests.append({"expr": f"{rec}{tag}: PCIe capacity = lanes x per-lane rate",
                          "eval_time": "20m", "exp_samples": samples})
    if capacity_queries == 0:
        fail.add("dashboard", "no query with the legend '... link capacity' (per-GPU PCIe capacity)")
    for unit, n in gpu_time_checked.items():
        if n == 0:
            fail.add("dashboard", f"no {GPU_TIME} query with the legend {{{{gpu_bottleneck}}}} in a panel "
                                  f"of unit {unit!r} ({GPU_TIME_UNITS[unit][0]} per class)")
    rules_file = work / "dashboard.rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]},
                                         sort_keys=False, width=1000))
    r = run([tools["promtool"], "check", "rules", rules_file])
    if r.returncode != 0:
        fail.add("promtool", (r.stdout + r.stderr).strip())
        return
    test_file = work / "dashboard.test.yaml"
    test_file.write_text(yaml.safe_dump({
        "rule_files": [rules_file.name], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": synthetic_series(series),
                   "promql_expr_test": tests}]}, sort_keys=False, width=1000))
    r = run([tools["promtool"], "test", "rules", test_file], cwd=work)
    if r.returncode != 0:
        fail.add("promtool", "a dashboard query returned no data, lacks a label its legend shows, "
                 "or computed a wrong value on the synthetic series:\n"
                 + (r.stdout + r.stderr).strip())


# ------------------------------------------------------------------------------- driver

def check_all(deploy, tools, work, stages):
    fail = Failures()
    deploy, work = deploy.resolve(), work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if "yaml" in stages:
        yamls = sorted(str(p) for p in deploy.glob("*.yaml"))
        r = run([tools["yamllint"], "--strict", "-c", CI / "yamllint.yaml", *yamls])
        if r.returncode != 0:
            fail.add("yamllint", (r.stdout + r.stderr).strip())
    series = load_catalogue(deploy, fail)
    objs = check_manifests(deploy, tools, work, fail) if "k8s" in stages else []
    if "collector" in stages:
        check_collector(deploy, tools, objs, fail)
    if "dashboard" in stages:
        try:
            dash = json.loads((deploy / "grafana-dashboard.json").read_text())
        except json.JSONDecodeError as e:
            fail.add("dashboard", f"grafana-dashboard.json: {e}")
            return fail
        queries = dashboard_queries(dash, series, fail)
        if "tsc" in stages:
            check_dashboard_types(dash, tools, work, fail)
        if "promtool" in stages:
            check_promtool(queries, series, tools, work, fail)
    return fail


ALL_STAGES = {"yaml", "k8s", "collector", "dashboard", "tsc", "promtool"}


def self_test(tools, work):
    """Breaks copies of deploy/ in known ways; every one must be caught, by the named stage."""

    def yaml_edit(fn):
        def edit(d):
            p = d / "daemonset.yaml"
            docs = list(yaml.safe_load_all(p.read_text()))
            fn(docs)
            p.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        return edit

    def agent_sc(docs):
        return docs[2]["spec"]["template"]["spec"]["containers"][0]["securityContext"]

    def dash_edit(fn):
        def edit(d):
            p = d / "grafana-dashboard.json"
            dash = json.loads(p.read_text())
            fn(dash)
            p.write_text(json.dumps(dash, indent=2))
        return edit

    def first_expr(dash, sub, new):
        for p in dash["panels"]:
            for t in p.get("targets", []):
                if sub in t["expr"]:
                    t["expr"] = t["expr"].replace(sub, new, 1)
                    return
        raise AssertionError(f"no expr contains {sub!r}")

    def text_edit(file, old, new):
        def edit(d):
            p = d / file
            s = p.read_text()
            assert old in s, (file, old)
            p.write_text(s.replace(old, new, 1))
        return edit

    def set_panel(key, value, ptype="timeseries"):
        def fn(dash):
            next(p for p in dash["panels"] if p["type"] == ptype)[key] = value
        return fn

    cases = [
        ("privileged: true", {"k8s"}, "policy", yaml_edit(lambda d: agent_sc(d).update(privileged=True))),
        ("SYS_ADMIN added", {"k8s"}, "policy",
         yaml_edit(lambda d: agent_sc(d)["capabilities"]["add"].append("SYS_ADMIN"))),
        ("hostPID off", {"k8s"}, "policy",
         yaml_edit(lambda d: d[2]["spec"]["template"]["spec"].update(hostPID=False))),
        ("misspelled field", {"k8s"}, "kubernetes",
         yaml_edit(lambda d: agent_sc(d).update(readOnlyRootFilesytem=True))),
        ("wrong type", {"k8s"}, "kubernetes",
         yaml_edit(lambda d: d[2]["spec"].update(minReadySeconds="ten"))),
        ("bad YAML indentation", {"yaml"}, "yamllint",
         text_edit("otel-collector.yaml", "  memory_limiter:\n", "   memory_limiter:\n")),
        ("collector: unknown key", {"collector"}, "collector schema",
         text_edit("otel-collector.yaml", "    metric_expiration: 5m", "    metric_expiry: 5m")),
        ("collector: undefined processor", {"collector", "k8s"}, "collector",
         text_edit("otel-collector.yaml", "resource/node, batch]", "resource/node, k8sattributes, batch]")),
        ("collector: suffixes off", {"collector", "k8s"}, "collector",
         text_edit("otel-collector.yaml", "    metric_expiration: 5m", "    metric_expiration: 5m\n    add_metric_suffixes: false")),
        ("agent port != collector port", {"collector", "k8s"}, "collector",
         text_edit("daemonset.yaml", "http://$(HOST_IP):4317", "http://$(HOST_IP):4316")),
        ("PromQL syntax error", {"dashboard"}, "promql",
         dash_edit(lambda d: first_expr(d, "rate(", "rate(("))),
        ("unknown metric", {"dashboard"}, "promql",
         dash_edit(lambda d: first_expr(d, "gpu_cuda_launches_total", "gpu_cuda_launches"))),
        ("unknown label", {"dashboard"}, "promql",
         dash_edit(lambda d: first_expr(d, 'k8s_node_name=~"$node"', 'node=~"$node"'))),
        ("catalogue name wrong", {"dashboard"}, "metrics",
         text_edit("metrics.yaml", "prometheus: hw_power_watts", "prometheus: hw_power")),
        ("legend label the query drops", {"dashboard", "promtool"}, "promtool",
         dash_edit(lambda d: first_expr(d, "max by (k8s_node_name, gpu_index) (hw_power_watts",
                                        "max by (k8s_node_name) (hw_power_watts"))),
        ("query returns nothing", {"dashboard", "promtool"}, "promtool",
         dash_edit(lambda d: first_expr(d, 'hw_gpu_task="general"', 'hw_gpu_task="graphics"'))),
        ("wrong PCIe per-lane rate", {"dashboard", "promtool"}, "promtool",
         dash_edit(lambda d: [first_expr(d, "0.98462e9", "0.98462e8") for _ in range(2)])),
        ("unknown bottleneck class", {"dashboard"}, "promql",
         dash_edit(lambda d: first_expr(d, 'gpu_bottleneck="gpu_bound"', 'gpu_bottleneck="gpu-bound"'))),
        ("table groups by a label the metric lacks", {"dashboard", "promtool"}, "promtool",
         dash_edit(lambda d: first_expr(d, "sum by (k8s_namespace_name, k8s_pod_name) (increase(gpu_cuda_time",
                                        "sum by (k8s_namespace_name, process_pid) (increase(gpu_cuda_time"))),
        ("GPU-hours from a rate", {"dashboard", "promtool"}, "promtool",
         dash_edit(lambda d: first_expr(d, "sum by (gpu_bottleneck) (increase(", "sum by (gpu_bottleneck) (rate("))),
        ("share of a wrong total", {"dashboard", "promtool"}, "promtool",
         dash_edit(lambda d: first_expr(d, "group_left sum(rate(", "group_left count(rate("))),
        ("unknown panel option", {"dashboard", "tsc"}, "grafana schema",
         dash_edit(set_panel("maxDataPoint", 100))),
        ("bad enum value", {"dashboard", "tsc"}, "grafana schema",
         dash_edit(lambda d: next(p for p in d["panels"] if p["type"] == "timeseries")["options"]
                   ["legend"].update(placement="left"))),
    ]
    bad = []
    for name, stages, want, edit in cases:
        d = work / "self-test" / re.sub(r"\W+", "-", name)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(ROOT / "deploy", d, ignore=shutil.ignore_patterns("ci"))
        edit(d)
        fail = check_all(d, tools, d / ".work", stages)
        hits = [f for f in fail.items if f.startswith(f"[{want}")]
        status = "caught" if hits else "MISSED"
        print(f"  self-test {status}: {name}" + (f" -> {hits[0].splitlines()[0][:110]}" if hits else ""))
        if not hits:
            bad.append(f"{name}: expected a [{want}] failure, got {fail.items or 'none'}")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tools", type=Path, required=True, help="the tool dir run.sh installed")
    ap.add_argument("--work", type=Path, required=True, help="scratch dir for rendered files")
    ap.add_argument("--self-test", action="store_true",
                    help="also check that broken copies of deploy/ are rejected")
    args = ap.parse_args()
    t = args.tools.resolve()
    tools = {"yamllint": t / "venv/bin/yamllint",
             "kubernetes-validate": t / "venv/bin/kubernetes-validate",
             "check-jsonschema": t / "venv/bin/check-jsonschema",
             "kubectl": t / "bin/kubectl", "promtool": t / "bin/promtool",
             "node": shutil.which("node") or "node", "node_modules": t / "node/node_modules"}
    fail = check_all(ROOT / "deploy", tools, args.work, ALL_STAGES)
    for f in fail.items:
        print(f"deploy check FAILED {f}", file=sys.stderr)
    bad = self_test(tools, args.work) if args.self_test else []
    for b in bad:
        print(f"deploy self-test FAILED: {b}", file=sys.stderr)
    if fail or bad:
        return 1
    print("deploy: manifests, collector config, metric catalogue and dashboard are valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())

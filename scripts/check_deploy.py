#!/usr/bin/env python3
"""Checks of the deployment files, run by scripts/check-deploy (see there). Subcommands:
rules (the PrometheusRule and deploy/prometheus/rules.yaml agree), k8s (the rendered overlays:
CRDs, hardening, Pod Security "restricted", one image, the generated ConfigMap; writes the
non-CRD documents of each overlay for kubernetes-validate), crds (the ServiceMonitor and
PrometheusRule of each overlay against the prometheus-operator's API schema), static (ECS task definition, IAM
policies against the CloudFormation template, Dockerfile), schema (config/schema.json is what
the binary prints, every shipped config names it and validates against it, and wrong copies
fail, as an editor would show), live (service + Prometheus on loopback)."""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAILURES = []


def fail(msg):
    FAILURES.append(msg)
    print(f"  FAIL {msg}")


def ok(msg):
    print(f"  ok   {msg}")


def load_yaml(path):
    with open(os.path.join(ROOT, path)) as f:
        return list(yaml.safe_load_all(f))


MONITORING = "k8s/components/monitoring"


def rules():
    crd = load_yaml(f"{MONITORING}/prometheusrule.yaml")[0]
    file = load_yaml("deploy/prometheus/rules.yaml")[0]
    if crd["spec"] != file:
        fail(
            "deploy/prometheus/rules.yaml differs from spec of k8s/prometheusrule.yaml (copy the groups over)"
        )
    else:
        ok("deploy/prometheus/rules.yaml is the PrometheusRule's spec")
    for r in crd["spec"]["groups"][0]["rules"]:
        if not r.get("annotations", {}).get("runbook_url", "").endswith(anchor(r["alert"])):
            fail(f"{r['alert']}: runbook_url should point at #{anchor(r['alert'])}")
    runbook = open(os.path.join(ROOT, "docs/runbook.md")).read()
    for r in crd["spec"]["groups"][0]["rules"]:
        title = re.sub(r"^DdbAggregator", "", r["alert"])
        words = re.sub(r"(?<!^)([A-Z])", r" \1", title).lower()
        if f"## {words}" not in runbook.lower():
            fail(f"{r['alert']}: docs/runbook.md has no section '## {words}'")
    ok("every alert has a runbook section")


def anchor(alert):
    title = re.sub(r"^DdbAggregator", "", alert)
    return re.sub(r"(?<!^)([A-Z])", r"-\1", title).lower()


def k8s(rendered):
    """Checks of every overlay as kustomize rendered it (one <overlay>.yaml per overlay in
    `rendered`); writes <overlay>.core.yaml, the documents kubernetes-validate knows."""
    overlays = sorted(
        f[:-5] for f in os.listdir(rendered) if f.endswith(".yaml") and not f.endswith(".core.yaml")
    )
    expected = sorted(d for d in os.listdir(os.path.join(ROOT, "k8s/overlays")))
    (ok if overlays == expected else fail)(f"every overlay rendered {overlays}")
    for name in overlays:
        docs = [d for d in load_yaml(os.path.join(rendered, f"{name}.yaml")) if d]
        core = [d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com/")]
        with open(os.path.join(rendered, f"{name}.core.yaml"), "w") as f:
            yaml.safe_dump_all(core, f)
        k8s_overlay(name, docs)


# The prometheus-operator's API, as the npm package @kubernetes-models/prometheus-operator ships
# it (generated from the operator's Go types): compiled JSON-schema validators (types, enums,
# required fields, formats) and TypeScript declarations. The validators accept unknown fields,
# so the declarations are walked as well, and a field they do not declare (a typo such as
# `interval` spelled `intreval`, which the operator would drop in silence) is an error.
VALIDATE_JS = """
import fs from "node:fs";
import { pathToFileURL } from "node:url";
const [models, file] = process.argv.slice(2);
let bad = 0;
for (const d of JSON.parse(fs.readFileSync(file, "utf8"))) {
  const [group, version] = d.apiVersion.split("/");
  const mod = await import(pathToFileURL(`${models}/${group}/${version}/${d.kind}.js`));
  try { new mod[d.kind](d).validate(); }
  catch (e) {
    bad++;
    const errors = (e.errors ?? [e]).map(x => `${x.instancePath ?? ""} ${x.message}`);
    console.log(`${d.kind} ${d.metadata?.name}: ${errors.join("; ")}`);
  }
}
process.exit(bad ? 1 : 0);
"""


def ts_interface(path, _cache={}):  # noqa: B006 - the default dict is the memo, on purpose
    """(properties name -> type, imports name -> .d.ts path) of the interface a .d.ts declares,
    inherited properties included."""
    if path in _cache:
        return _cache[path]
    text = open(path).read()
    imports = {}
    for names, src in re.findall(r'^import \{ ([^}]*) \} from "([^"]+)";', text, re.M):
        if src.startswith("."):
            target = os.path.join(os.path.dirname(path), re.sub(r"\.js$", "", src) + ".d.ts")
        else:
            target = os.path.join(path.split("/node_modules/")[0], "node_modules", src + ".d.ts")
        for n in names.split(","):
            imports[n.strip()] = target
    m = re.search(r"^export interface \w+(?: extends ([^{]+))? \{\n(.*?)^\}", text, re.M | re.S)
    props = {}
    if m:
        body = re.sub(r"^\s*/?\*.*$\n", "", m.group(2), flags=re.M)
        props = dict(re.findall(r'^    "([^"]+)"\??: (.+?);?$', body, re.M))
        for base in (m.group(1) or "").split(","):
            base = base.strip()
            if base in imports and os.path.exists(imports[base]):
                props = {**ts_interface(imports[base])[0], **props}
    _cache[path] = (props, imports)
    return _cache[path]


def unknown_fields(value, dts, where):
    if not isinstance(value, dict) or not os.path.exists(dts):
        return []
    props, imports = ts_interface(dts)
    if not props:
        return []
    out = []
    for k, v in value.items():
        if k not in props:
            out.append(f"{where}.{k}")
            continue
        t = props[k]
        arr = re.fullmatch(r"Array<(\w+)>", t)
        if arr and arr.group(1) in imports and isinstance(v, list):
            for i, item in enumerate(v):
                out += unknown_fields(item, imports[arr.group(1)], f"{where}.{k}[{i}]")
        elif t in imports:
            out += unknown_fields(v, imports[t], f"{where}.{k}")
    return out


def crds(rendered, models):
    """The monitoring.coreos.com documents of every rendered overlay against the operator's API."""
    script = os.path.join(rendered, "validate-crds.mjs")
    open(script, "w").write(VALIDATE_JS)
    for f in sorted(os.listdir(rendered)):
        if not f.endswith(".yaml") or f.endswith(".core.yaml"):
            continue
        name = f[:-5]
        docs = [
            d
            for d in load_yaml(os.path.join(rendered, f))
            if d and d["apiVersion"].startswith("monitoring.coreos.com/")
        ]
        if not docs:
            continue
        js = os.path.join(rendered, f"{name}.crds.json")
        json.dump(docs, open(js, "w"))
        r = subprocess.run(["node", script, models, js], capture_output=True, text=True)
        kinds = sorted(d["kind"] for d in docs)
        (ok if r.returncode == 0 else fail)(
            f"{name}: {', '.join(kinds)} valid against the prometheus-operator's schema {r.stdout.strip()}{r.stderr.strip()[-500:]}"
        )
        for d in docs:
            group, version = d["apiVersion"].split("/")
            extra = unknown_fields(
                d, os.path.join(models, group, version, f"{d['kind']}.d.ts"), d["kind"]
            )
            (ok if not extra else fail)(
                f"{name}: {d['kind']}: every field is one the operator knows {extra if extra else ''}"
            )


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def pod_specs(docs):
    """(name, pod spec) of every workload."""
    for d in docs:
        if d["kind"] == "Deployment" or d["kind"] == "Job":
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]
        elif d["kind"] == "CronJob":
            yield d["metadata"]["name"], d["spec"]["jobTemplate"]["spec"]["template"]["spec"]


def restricted(pod):
    """What Pod Security Standards' "restricted" level asks of a pod, as far as our pods go."""
    psc = pod.get("securityContext", {})
    problems = []
    if psc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        problems.append("seccompProfile RuntimeDefault")
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c.get("securityContext", {})
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            problems.append(f"{c['name']}: runAsNonRoot")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            problems.append(f"{c['name']}: runAsUser 0")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{c['name']}: allowPrivilegeEscalation false")
        if sc.get("capabilities", {}).get("drop") != ["ALL"] or sc.get("capabilities", {}).get(
            "add"
        ):
            problems.append(f"{c['name']}: drop ALL capabilities, add none")
        if sc.get("privileged"):
            problems.append(f"{c['name']}: privileged")
    for v in pod.get("volumes", []):
        if not set(v) - {"name"} <= {
            "configMap",
            "secret",
            "emptyDir",
            "projected",
            "downwardAPI",
            "persistentVolumeClaim",
            "ephemeral",
            "csi",
        }:
            problems.append(f"volume {v['name']}: type not allowed")
    if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
        problems.append("host namespaces")
    return problems


def k8s_overlay(name, docs):
    kinds = {d["kind"] for d in docs}
    monitoring = {"ServiceMonitor", "PrometheusRule"} <= kinds
    (ok if name != "production" or monitoring else fail)(
        f"{name}: monitoring component (ServiceMonitor, PrometheusRule) {'in' if monitoring else 'not in'} it"
    )
    (ok if name == "reconcile-customer" or not by_kind(docs, "Job") else fail)(
        f"{name}: no one-off Job unless asked for"
    )
    for sm in by_kind(docs, "ServiceMonitor"):
        svc_ports = {p["name"] for s in by_kind(docs, "Service") for p in s["spec"]["ports"]}
        good = (
            sm["spec"].get("selector")
            and sm["spec"].get("endpoints")
            and all(e.get("port") in svc_ports for e in sm["spec"]["endpoints"])
        )
        (ok if good else fail)(
            f"{name}: ServiceMonitor has a selector and endpoints on a port of the Service"
        )
    for pr in by_kind(docs, "PrometheusRule"):
        good = all(
            r.get("alert") and r.get("expr") for g in pr["spec"]["groups"] for r in g["rules"]
        )
        (ok if good else fail)(f"{name}: PrometheusRule: every rule has alert and expr")
    for d in by_kind(docs, "ServiceMonitor") + by_kind(docs, "PrometheusRule"):
        (ok if d["metadata"].get("labels", {}).get("release") else fail)(
            f"{name}: {d['kind']} carries the release label a kube-prometheus-stack selects"
        )
    ns = by_kind(docs, "Namespace")[0]
    (
        ok
        if ns["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce")
        == "restricted"
        else fail
    )(f"{name}: namespace enforces Pod Security 'restricted'")
    images = {c["image"] for _, pod in pod_specs(docs) for c in pod["containers"]}
    (ok if len(images) == 1 and "/" in next(iter(images)) else fail)(
        f"{name}: one image, from the base's images: entry {sorted(images)}"
    )
    cms = [c["metadata"]["name"] for c in by_kind(docs, "ConfigMap")]
    generated = len(cms) == 1 and re.fullmatch(r"ddb-aggregator-config-[a-z0-9]{10}", cms[0])
    (ok if generated else fail)(f"{name}: ConfigMap generated with a content hash {cms}")
    for wname, pod in pod_specs(docs):
        problems = restricted(pod)
        (ok if not problems else fail)(
            f"{name}: {wname} meets Pod Security 'restricted' {problems if problems else ''}"
        )
        refs = {v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v}
        (ok if refs == set(cms) else fail)(
            f"{name}: {wname} mounts the generated ConfigMap {sorted(refs)}"
        )
        sa = pod.get("serviceAccountName")
        want = "ddb-aggregator" if wname == "ddb-aggregator" else "ddb-aggregator-operator"
        (ok if sa == want else fail)(f"{name}: {wname} runs as ServiceAccount {want}")
    sas = {s["metadata"]["name"]: s for s in by_kind(docs, "ServiceAccount")}
    for sa in ("ddb-aggregator", "ddb-aggregator-operator"):
        (
            ok
            if "eks.amazonaws.com/role-arn"
            in sas.get(sa, {}).get("metadata", {}).get("annotations", {})
            else fail
        )(f"{name}: ServiceAccount {sa} annotated for IRSA")
    dep = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "ddb-aggregator"][0]
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    spread = {t["topologyKey"] for t in pod.get("topologySpreadConstraints", [])}
    checks = {
        "2 replicas": dep["spec"]["replicas"] == 2,
        "liveness on /healthz": c["livenessProbe"]["httpGet"]["path"] == "/healthz",
        "readiness on /readyz": c["readinessProbe"]["httpGet"]["path"] == "/readyz",
        "read-only root filesystem": c["securityContext"].get("readOnlyRootFilesystem") is True,
        "requests and limits": bool(c["resources"].get("requests"))
        and bool(c["resources"].get("limits")),
        "grace period above the 10 s drain": pod["terminationGracePeriodSeconds"] > 10,
        "spread over zones and nodes": {"topology.kubernetes.io/zone", "kubernetes.io/hostname"}
        <= spread,
    }
    for what, good in checks.items():
        (ok if good else fail)(f"{name}: Deployment: {what}")
    for cj in by_kind(docs, "CronJob"):
        good = (
            cj["spec"].get("timeZone")
            and cj["spec"].get("startingDeadlineSeconds")
            and cj["spec"].get("concurrencyPolicy") == "Forbid"
        )
        (ok if good else fail)(
            f"{name}: CronJob {cj['metadata']['name']}: timeZone, startingDeadlineSeconds, concurrencyPolicy Forbid"
        )
    policies = by_kind(docs, "NetworkPolicy")
    covered = all(
        any(
            set(p["spec"].get("policyTypes", [])) == {"Ingress", "Egress"}
            and selects(p["spec"]["podSelector"], pod_labels(d))
            for p in policies
        )
        for d in docs
        if d["kind"] in ("Deployment", "CronJob", "Job")
    )
    (ok if covered else fail)(
        f"{name}: a NetworkPolicy restricts ingress and egress of every workload"
    )


def pod_labels(d):
    t = (
        d["spec"]["jobTemplate"]["spec"]["template"]
        if d["kind"] == "CronJob"
        else d["spec"]["template"]
    )
    return t.get("metadata", {}).get("labels", {})


def selects(selector, labels):
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    return all(
        labels.get(e["key"]) in e["values"]
        for e in selector.get("matchExpressions", [])
        if e["operator"] == "In"
    )


SQS_CALLS = {
    "send_message",
    "receive_message",
    "delete_message",
    "get_queue_attributes",
    "get_queue_url",
    "change_message_visibility",
}
DDB_CALLS = {
    "describe_table",
    "describe_time_to_live",
    "create_table",
    "describe_stream",
    "list_streams",
    "get_shard_iterator",
    "get_records",
    "get_item",
    "put_item",
    "update_item",
    "delete_item",
    "query",
    "scan",
    "batch_get_item",
    "batch_write_item",
    "transact_write_items",
}
# Calls that IAM authorizes per item action: TransactWriteItems has no action of its own, each
# Update in it needs dynamodb:UpdateItem (src/ sends only Updates in transactions).
AUTHORIZED_AS = {"dynamodb:TransactWriteItems": "dynamodb:UpdateItem"}
# Called only with `state.create_table: true`; the CloudFormation template creates the table.
NOT_GRANTED = {"dynamodb:CreateTable"}
# Called only by `dlq replay`, which runs with the operator role.
OPERATOR_ONLY = {"sqs:ReceiveMessage", "sqs:DeleteMessage"}


def sdk_calls():
    """IAM actions of every AWS SDK call in src/ (`.describe_stream()` is dynamodb:DescribeStream)."""
    calls = set()
    for d, _, files in os.walk(os.path.join(ROOT, "src")):
        for f in files:
            if f.endswith(".rs"):
                for m in re.findall(r"\.([a-z_]+)\(\)", open(os.path.join(d, f)).read()):
                    prefix = "sqs" if m in SQS_CALLS else "dynamodb" if m in DDB_CALLS else None
                    if prefix:
                        action = f"{prefix}:" + "".join(w.capitalize() for w in m.split("_"))
                        calls.add(AUTHORIZED_AS.get(action, action))
    return calls


class CfnLoader(yaml.SafeLoader):
    """YAML with CloudFormation's short tags (!Sub, !Ref, ...) as their long forms."""


def _cfn_tag(loader, suffix, node):
    name = "Ref" if suffix == "Ref" else f"Fn::{suffix}"
    if isinstance(node, yaml.ScalarNode):
        value = loader.construct_scalar(node)
        return {name: value.split(".", 1) if suffix == "GetAtt" else value}
    if isinstance(node, yaml.SequenceNode):
        return {name: loader.construct_sequence(node, deep=True)}
    return {name: loader.construct_mapping(node, deep=True)}


CfnLoader.add_multi_constructor("!", _cfn_tag)


def statements(doc):
    """Sid -> sorted actions of a policy document (template statements under Fn::If included)."""
    out = {}
    for st in doc["Statement"]:
        if "Fn::If" in st:
            st = st["Fn::If"][1]
        acts = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        out[st["Sid"]] = sorted(acts)
    return out


def static():
    # IAM: exact actions, no wildcards, every action called and none that is not.
    pols = {
        name: json.load(open(os.path.join(ROOT, f"deploy/iam/{name}.json")))
        for name in ("policy", "operator-policy")
    }
    bad = []
    for pol in pols.values():
        for st in pol["Statement"]:
            acts = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
            res = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
            bad += [a for a in acts if "*" in a]
            bad += [r for r in res if r == "*" or r.endswith(":*") or re.search(r":table/\*", r)]
            if st.get("Effect") != "Allow" or "NotAction" in st or "NotResource" in st:
                bad.append(st.get("Sid", "?"))
    (ok if not bad else fail)(
        f"IAM policies: exact actions and resources, no wildcards {bad if bad else ''}"
    )
    granted = {
        name: {a for acts in statements(pol).values() for a in acts} for name, pol in pols.items()
    }
    called = sdk_calls()
    service_needs = called - NOT_GRANTED - OPERATOR_ONLY
    (ok if service_needs <= granted["policy"] else fail)(
        f"service policy grants every call of src/ {sorted(service_needs - granted['policy'])}"
    )
    (ok if granted["policy"] <= service_needs else fail)(
        f"service policy grants nothing src/ never calls {sorted(granted['policy'] - service_needs)}"
    )
    (ok if granted["operator-policy"] == OPERATOR_ONLY & called else fail)(
        f"operator policy adds exactly what dlq replay calls {sorted(granted['operator-policy'])}"
    )
    # The CloudFormation template's policies are the same statements.
    cfn = yaml.load(
        open(os.path.join(ROOT, "deploy/cloudformation/ddb-aggregator.yaml")), Loader=CfnLoader
    )
    res = cfn["Resources"]
    tpl = {
        "policy": statements(res["ServicePolicy"]["Properties"]["PolicyDocument"]),
        "operator-policy": statements(res["OperatorPolicy"]["Properties"]["PolicyDocument"]),
    }
    tpl["policy"].pop("EncryptDeadLetters", None)
    for name, pol in pols.items():
        same = statements(pol) == tpl[name]
        (ok if same else fail)(
            f"deploy/iam/{name}.json has the statements of the CloudFormation template"
        )
    kinds = {r["Type"] for r in res.values()}
    (
        ok
        if {"AWS::DynamoDB::Table", "AWS::SQS::Queue", "AWS::CloudWatch::Alarm"} <= kinds
        else fail
    )("CloudFormation: state table, queue, depth alarm")
    key = res["StateTable"]["Properties"]["KeySchema"]
    (ok if key == [{"AttributeName": "shard_id", "KeyType": "HASH"}] else fail)(
        "CloudFormation: the state table's key is what the service creates (shard_id)"
    )
    # ECS task definition.
    td = json.load(open(os.path.join(ROOT, "deploy/ecs/task-definition.json")))
    c = td["containerDefinitions"][0]
    ecs = {
        "family, roles, awsvpc": td.get("family")
        and td.get("taskRoleArn")
        and td.get("networkMode") == "awsvpc",
        "non-root user": c.get("user", "0").split(":")[0] not in ("", "0", "root"),
        "read-only root filesystem": c.get("readonlyRootFilesystem") is True,
        "not privileged": not c.get("privileged", False),
        "stopTimeout above the drain": c.get("stopTimeout", 0) > 10,
        "metrics port 9464": any(p["containerPort"] == 9464 for p in c.get("portMappings", [])),
        "run command": c.get("command", [None])[0] == "run",
        "config overrides are DDB_AGGREGATOR__ variables": all(
            e["name"].startswith(("AWS_", "RUST_", "DDB_AGGREGATOR__"))
            for e in c.get("environment", [])
        ),
        "config from a secret named by --config env:NAME": any(
            a.startswith("env:") and any(sec["name"] == a[4:] for sec in c.get("secrets", []))
            for a in c.get("command", [])
        ),
        "health check by the binary (no curl in the image)": c.get("healthCheck", {}).get(
            "command", []
        )[1:3]
        == ["/usr/local/bin/ddb-aggregator", "healthcheck"],
        "log group created if missing": c.get("logConfiguration", {})
        .get("options", {})
        .get("awslogs-create-group")
        == "true",
        "CloudWatch agent scrape labels": c.get("dockerLabels", {}).get(
            "ECS_PROMETHEUS_EXPORTER_PORT"
        )
        == "9464",
    }
    for name, good in ecs.items():
        (ok if good else fail)(f"ECS task definition: {name}")
    # Its placeholders are the template's outputs (docs/deploy-ecs.md, step 5, fills them in), and
    # the execution role the template creates can do what the task definition asks of it.
    placeholders = {
        "SERVICE_ROLE_ARN": "ServiceRoleArn",
        "TASK_EXECUTION_ROLE_ARN": "TaskExecutionRoleArn",
        "QUEUE_URL": "QueueUrl",
        "CONFIG_PARAMETER_ARN": "ConfigParameterArn",
    }
    used = {
        td["taskRoleArn"],
        td["executionRoleArn"],
        *(e["value"] for e in c["environment"]),
        *(x["valueFrom"] for x in c["secrets"]),
    }
    missing = sorted(
        p for p, out in placeholders.items() if p not in used or out not in cfn["Outputs"]
    )
    (ok if not missing else fail)(
        f"ECS task definition: roles, queue and config parameter are the template's outputs {missing if missing else ''}"
    )
    exe = res.get("TaskExecutionRole", {}).get("Properties", {})
    exe_actions = {
        a
        for pol in exe.get("Policies", [])
        for acts in statements(pol["PolicyDocument"]).values()
        for a in acts
    }
    params = cfn["Parameters"]
    good = {
        "ssm:GetParameters",
        "logs:CreateLogGroup",
        "logs:CreateLogStream",
        "logs:PutLogEvents",
    } <= exe_actions and c["logConfiguration"]["options"]["awslogs-group"] == params[
        "LogGroupName"
    ]["Default"]
    (ok if good else fail)(
        "CloudFormation: the ECS execution role reads the config parameter and creates and writes the task's log group"
    )
    # Dockerfile.
    df = open(os.path.join(ROOT, "Dockerfile")).read()
    froms = re.findall(r"^FROM\s+(\S+)", df, re.M)
    docker = {
        "multi-stage": len(froms) >= 2,
        "pinned bases (no :latest, a version tag)": all(
            ":" in f and not f.endswith(":latest") for f in froms
        ),
        "distroless or equally small runtime": "distroless" in froms[-1],
        "non-root user": re.search(r"^USER\s+(nonroot|\d+)", df, re.M) is not None
        and not re.search(r"^USER\s+(root|0)\b", df, re.M),
        "cargo build --release --locked": "cargo build --release --locked" in df,
        "exec-form ENTRYPOINT (no shell at run time)": re.search(r"^ENTRYPOINT\s+\[", df, re.M)
        is not None,
        "metrics port exposed": "EXPOSE 9464" in df,
        ".dockerignore": os.path.exists(os.path.join(ROOT, ".dockerignore")),
    }
    for name, good in docker.items():
        (ok if good else fail)(f"Dockerfile: {name}")


SHIPPED_CONFIGS = [
    "config/commerce.yaml",
    "config/commerce-measures.yaml",
    "config/ledger.yaml",
    "config/saas.yaml",
    "bench/ddb-aggregator.yaml",
    "k8s/base/config.yaml",
]
SCHEMA_LINE = re.compile(r"^# yaml-language-server: \$schema=(\S+)$", re.M)


def wrong_copies(text):
    """Copies of config/commerce.yaml with one mistake each, as a user might type them."""
    yield "a wrong top-level key", text.replace("\nmetrics:", "\nmetric:", 1)
    yield (
        "a wrong key inside a measure",
        text.replace(
            "revenue: { sum: total }", "revenue: { sum: total, wher: { status: { S: [PAID] } } }", 1
        ),
    )
    yield "a wrong measure kind", text.replace("orderCount: count", "orderCount: counts", 1)
    yield "a wrong filter operator", text.replace('{ prefix: "ORDER#" }', '{ prefx: "ORDER#" }', 1)
    yield "a duration without a unit", text.replace("lease_duration: 10s", "lease_duration: 10", 1)


def schema(binary):
    import jsonschema

    path = os.path.join(ROOT, "config/schema.json")
    committed = open(path).read()
    printed = subprocess.run([binary, "schema"], capture_output=True, text=True, check=True).stdout
    (ok if printed == committed else fail)(
        "config/schema.json is what `ddb-aggregator schema` prints"
        + (
            ""
            if printed == committed
            else " (regenerate it: ddb-aggregator schema > config/schema.json)"
        )
    )
    validator = jsonschema.Draft7Validator(json.loads(committed))
    for name in SHIPPED_CONFIGS:
        text = open(os.path.join(ROOT, name)).read()
        line = SCHEMA_LINE.search(text)
        target = line and os.path.normpath(os.path.join(os.path.dirname(name), line.group(1)))
        (ok if target == "config/schema.json" else fail)(
            f"{name} names config/schema.json for editors"
        )
        errors = [e.message for e in validator.iter_errors(yaml.safe_load(text))]
        shown = f": {errors[:2]}" if errors else ""
        (ok if not errors else fail)(f"{name} validates against the schema{shown}")
    base = open(os.path.join(ROOT, "config/commerce.yaml")).read()
    for what, text in wrong_copies(base):
        if text == base:
            fail(f"the wrong copy with {what} is not different: update wrong_copies()")
            continue
        errors = list(validator.iter_errors(yaml.safe_load(text)))
        (ok if errors else fail)(f"a copy of config/commerce.yaml with {what} fails the schema")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_until(what, fn, seconds):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if fn():
                return
        except Exception:  # noqa: BLE001 - not up yet (refused, half-started): ask again
            pass
        time.sleep(0.5)
    raise SystemExit(f"check-deploy: timed out waiting for {what}")


def live(work, binary, aws_python):
    ddb_port, sqs_port = os.environ["DDB_LOCAL_PORT"], os.environ["SQS_LOCAL_PORT"]
    suffix = f"{os.getpid()}"
    table, state, queue = (
        f"deploycheck-{suffix}",
        f"deploycheck-state-{suffix}",
        f"deploycheck-dlq-{suffix}",
    )
    env = dict(
        os.environ,
        AWS_REGION="us-east-1",
        AWS_ACCESS_KEY_ID="local",
        AWS_SECRET_ACCESS_KEY="local",
        AWS_ENDPOINT_URL_DYNAMODB=f"http://127.0.0.1:{ddb_port}",
        AWS_ENDPOINT_URL_DYNAMODB_STREAMS=f"http://127.0.0.1:{ddb_port}",
        AWS_ENDPOINT_URL_SQS=f"http://127.0.0.1:{sqs_port}",
        DEMO_TABLE=table,
        DEMO_STATE=state,
        DEMO_QUEUE=queue,
    )

    def data(*a):
        return subprocess.run(
            [aws_python, os.path.join(ROOT, "scripts/demo_data.py"), *a],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )

    data("setup")
    metrics_port, prom_port = free_port(), free_port()
    svc_env = dict(
        env,
        DDB_AGGREGATOR__SOURCE__TABLE=table,
        DDB_AGGREGATOR__AGGREGATES__TABLE=table,
        DDB_AGGREGATOR__STATE__TABLE=state,
        DDB_AGGREGATOR__STATE__LEASE_DURATION="2s",
        DDB_AGGREGATOR__RECONCILE__INTERVAL="2s",
        DDB_AGGREGATOR__DEAD_LETTER__QUEUE_URL=f"http://127.0.0.1:{sqs_port}/000000000000/{queue}",
        DDB_AGGREGATOR__METRICS__LISTEN=f"127.0.0.1:{metrics_port}",
    )
    log = open(os.path.join(work, "service.log"), "w")
    svc = subprocess.Popen(
        [binary, "run", "--config", os.path.join(ROOT, "config/commerce.yaml")],
        env=svc_env,
        stdout=log,
        stderr=log,
    )
    prom_cfg = os.path.join(work, "prometheus.yml")
    with open(prom_cfg, "w") as f:
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "ddb-aggregator",
                        "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
                    }
                ],
            },
            f,
        )
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={prom_cfg}",
            f"--storage.tsdb.path={work}/tsdb",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(work, "prometheus.log"), "w"),
    )
    try:
        wait_until(
            "the service's /readyz",
            lambda: "ready" in http_get(f"http://127.0.0.1:{metrics_port}/readyz"),
            60,
        )
        wait_until(
            "Prometheus", lambda: http_get(f"http://127.0.0.1:{prom_port}/-/ready") != "", 60
        )
        data("write")
        data("poison")
        wait_until(
            "the aggregates",
            lambda: (
                subprocess.run(
                    [aws_python, os.path.join(ROOT, "scripts/demo_data.py"), "show", "--check"],
                    env=env,
                ).returncode
                == 0
            ),
            60,
        )
        data("drift")
        # The schedule (every 2 s) reconciles c1, which the drift's order touched.
        wait_until(
            "a scheduled reconcile with a correction",
            lambda: re.search(
                r"^ddb_aggregator_reconcile_corrections_total\{rule=\"customer-orders\"\} [1-9]",
                http_get(f"http://127.0.0.1:{metrics_port}/metrics"),
                re.M,
            ),
            60,
        )
        # ... and finishes with no drift left (the gauge the reconcile-not-succeeding alert reads).
        wait_until(
            "a scheduled reconcile that finished with no drift left",
            lambda: re.search(
                r"^ddb_aggregator_reconcile_last_success_timestamp_seconds [0-9]",
                http_get(f"http://127.0.0.1:{metrics_port}/metrics"),
                re.M,
            ),
            120,
        )
        wait_until(
            "a dead letter",
            lambda: re.search(
                r'^ddb_aggregator_dead_letters_total\{reason="non_numeric_sum"\} 1',
                http_get(f"http://127.0.0.1:{metrics_port}/metrics"),
                re.M,
            ),
            60,
        )
        time.sleep(8)  # several scrapes, so rate() and increase() have samples
        text = http_get(f"http://127.0.0.1:{metrics_port}/metrics")
        open(os.path.join(work, "metrics.txt"), "w").write(text)
        lint = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
        )
        if lint.returncode != 0 or lint.stdout.strip() or lint.stderr.strip():
            fail(f"promtool check metrics: {lint.stdout}{lint.stderr}")
        else:
            ok(
                f"promtool check metrics: no problems in {len(text.splitlines())} lines of live /metrics"
            )

        # Every PromQL expression of the dashboard and the alerts, through the HTTP API.
        def query(expr):
            url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode(
                {"query": expr}
            )
            try:
                body = json.loads(http_get(url))
            except urllib.error.HTTPError as e:
                body = json.loads(e.read().decode())
            return body

        dash = json.load(open(os.path.join(ROOT, "deploy/grafana/dashboard.json")))
        # The dashboard's variables as Grafana sends them with "All" selected.
        variables = {"$__rate_interval": "1m", "$job": ".*", "$namespace": ".*", "$instance": ".*"}
        names = {v["name"] for v in dash["templating"]["list"]}
        if not {"job", "namespace", "instance"} <= names:
            fail(
                f"dashboard: variables job, namespace and instance expected, found {sorted(names)}"
            )
        for panel in dash["panels"]:
            for t in panel["targets"]:
                expr = t["expr"]
                for k, v in variables.items():
                    expr = expr.replace(k, v)
                if "$" in expr:
                    fail(
                        f"dashboard '{panel['title']}' {t['refId']}: unknown variable in {t['expr']}"
                    )
                    continue
                r = query(expr)
                if r.get("status") != "success":
                    fail(f"dashboard '{panel['title']}' {t['refId']}: {r.get('error')}")
                elif not r["data"]["result"]:
                    fail(f"dashboard '{panel['title']}' {t['refId']}: no data for {t['expr']}")
                else:
                    ok(
                        f"dashboard '{panel['title']}' {t['refId']}: {len(r['data']['result'])} series"
                    )
        for rule in load_yaml("deploy/prometheus/rules.yaml")[0]["groups"][0]["rules"]:
            expr = rule["expr"]
            r = query(expr)
            lhs = re.split(r"\s(?:>|<|==|!=|>=|<=)\s", expr, maxsplit=1)[0]
            r2 = query(lhs)
            if r.get("status") != "success" or r2.get("status") != "success":
                fail(f"alert {rule['alert']}: {r.get('error') or r2.get('error')}")
            elif not r2["data"]["result"]:
                fail(f"alert {rule['alert']}: its measured side returns no data: {lhs}")
            else:
                ok(
                    f"alert {rule['alert']}: evaluates ({len(r['data']['result'])} firing, "
                    f"measured side {len(r2['data']['result'])} series)"
                )
    finally:
        svc.send_signal(signal.SIGTERM)
        try:
            code = svc.wait(timeout=15)
            (ok if code == 0 else fail)(f"service stopped on SIGTERM with exit code {code}")
        except subprocess.TimeoutExpired:
            svc.kill()
            fail("service did not stop within 15 s of SIGTERM")
        prom.terminate()
        prom.wait(timeout=15)
        if FAILURES:
            print(open(os.path.join(work, "service.log")).read()[-3000:])


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("command", choices=["rules", "k8s", "crds", "static", "schema", "live"])
    p.add_argument("--models")
    p.add_argument("--rendered")
    p.add_argument("--work")
    p.add_argument("--binary")
    p.add_argument("--aws-python")
    a = p.parse_args()
    {
        "rules": rules,
        "k8s": lambda: k8s(a.rendered),
        "crds": lambda: crds(a.rendered, a.models),
        "static": static,
        "schema": lambda: schema(a.binary),
        "live": lambda: live(a.work, a.binary, a.aws_python),
    }[a.command]()
    if FAILURES:
        print(f"check-deploy: {len(FAILURES)} problem(s)")
        sys.exit(1)


if __name__ == "__main__":
    main()

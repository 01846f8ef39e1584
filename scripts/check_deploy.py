#!/usr/bin/env python3
"""Checks of the deployment files, run by scripts/check-deploy (see there). Subcommands:
rules (the PrometheusRule and deploy/prometheus/rules.yaml agree), static (CRDs, ECS task
definition, IAM policy, Dockerfile), live (service + Prometheus on loopback)."""
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


def rules():
    crd = load_yaml("k8s/prometheusrule.yaml")[0]
    file = load_yaml("deploy/prometheus/rules.yaml")[0]
    if crd["spec"] != file:
        fail("deploy/prometheus/rules.yaml differs from spec of k8s/prometheusrule.yaml (copy the groups over)")
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


def static():
    # CRDs: required fields.
    sm = load_yaml("k8s/servicemonitor.yaml")[0]
    if sm.get("apiVersion") != "monitoring.coreos.com/v1" or sm.get("kind") != "ServiceMonitor" or not sm["spec"].get("endpoints") or not sm["spec"].get("selector"):
        fail("ServiceMonitor needs apiVersion monitoring.coreos.com/v1, spec.selector and spec.endpoints")
    else:
        svc = load_yaml("k8s/service.yaml")[0]
        ports = {p["name"] for p in svc["spec"]["ports"]}
        if not all(e.get("port") in ports for e in sm["spec"]["endpoints"]):
            fail("ServiceMonitor endpoints must name a port of the Service")
        else:
            ok("ServiceMonitor: required fields, port matches the Service")
    pr = load_yaml("k8s/prometheusrule.yaml")[0]
    if pr.get("kind") != "PrometheusRule" or not all(r.get("alert") and r.get("expr") for g in pr["spec"]["groups"] for r in g["rules"]):
        fail("PrometheusRule: every rule needs alert and expr")
    else:
        ok("PrometheusRule: required fields")
    # Deployment hardening beyond the schema.
    dep = load_yaml("k8s/deployment.yaml")[0]
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    checks = {
        "2 replicas": dep["spec"]["replicas"] == 2,
        "runAsNonRoot": pod["securityContext"].get("runAsNonRoot") is True,
        "readOnlyRootFilesystem": c["securityContext"].get("readOnlyRootFilesystem") is True,
        "capabilities dropped": c["securityContext"].get("capabilities", {}).get("drop") == ["ALL"],
        "no privilege escalation": c["securityContext"].get("allowPrivilegeEscalation") is False,
        "liveness on /healthz": c["livenessProbe"]["httpGet"]["path"] == "/healthz",
        "readiness on /readyz": c["readinessProbe"]["httpGet"]["path"] == "/readyz",
        "requests and limits": bool(c["resources"].get("requests")) and bool(c["resources"].get("limits")),
        "grace period above the 10 s drain": pod["terminationGracePeriodSeconds"] > 10,
    }
    for name, good in checks.items():
        (ok if good else fail)(f"Deployment: {name}")
    sa = load_yaml("k8s/serviceaccount.yaml")[0]
    (ok if "eks.amazonaws.com/role-arn" in sa["metadata"].get("annotations", {}) else fail)("ServiceAccount annotated for IRSA")
    kust = load_yaml("k8s/kustomization.yaml")[0]
    listed = set(kust["resources"])
    present = {f for f in os.listdir(os.path.join(ROOT, "k8s")) if f.endswith(".yaml") and f != "kustomization.yaml"}
    (ok if listed == present else fail)(f"kustomization lists every manifest ({sorted(present - listed)} missing)")
    # IAM: exact actions, no wildcards.
    pol = json.load(open(os.path.join(ROOT, "deploy/iam/policy.json")))
    bad = []
    for st in pol["Statement"]:
        acts = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        res = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
        bad += [a for a in acts if "*" in a]
        bad += [r for r in res if r == "*" or r.endswith(":*") or re.search(r":table/\*", r)]
        if st.get("Effect") != "Allow" or "NotAction" in st or "NotResource" in st:
            bad.append(st.get("Sid", "?"))
    (ok if not bad else fail)(f"IAM policy: exact actions and resources, no wildcards {bad if bad else ''}")
    needed = {"dynamodb:GetRecords", "dynamodb:GetShardIterator", "dynamodb:DescribeStream", "dynamodb:UpdateItem", "dynamodb:Query", "dynamodb:Scan", "sqs:SendMessage"}
    have = {a for st in pol["Statement"] for a in (st["Action"] if isinstance(st["Action"], list) else [st["Action"]])}
    (ok if needed <= have else fail)(f"IAM policy grants what the service calls {sorted(needed - have)}")
    # ECS task definition.
    td = json.load(open(os.path.join(ROOT, "deploy/ecs/task-definition.json")))
    c = td["containerDefinitions"][0]
    ecs = {
        "family, roles, awsvpc": td.get("family") and td.get("taskRoleArn") and td.get("networkMode") == "awsvpc",
        "non-root user": c.get("user", "0").split(":")[0] not in ("", "0", "root"),
        "read-only root filesystem": c.get("readonlyRootFilesystem") is True,
        "not privileged": not c.get("privileged", False),
        "stopTimeout above the drain": c.get("stopTimeout", 0) > 10,
        "metrics port 9464": any(p["containerPort"] == 9464 for p in c.get("portMappings", [])),
        "run command": c.get("command", [None])[0] == "run",
        "config overrides are DDB_AGGREGATOR__ variables": all(e["name"].startswith(("AWS_", "RUST_", "DDB_AGGREGATOR__")) for e in c.get("environment", [])),
        "config from a secret named by --config env:NAME": any(
            a.startswith("env:") and any(sec["name"] == a[4:] for sec in c.get("secrets", [])) for a in c.get("command", [])
        ),
        "health check by the binary (no curl in the image)": c.get("healthCheck", {}).get("command", [])[1:3] == ["/usr/local/bin/ddb-aggregator", "healthcheck"],
        "log group created if missing": c.get("logConfiguration", {}).get("options", {}).get("awslogs-create-group") == "true",
        "CloudWatch agent scrape labels": c.get("dockerLabels", {}).get("ECS_PROMETHEUS_EXPORTER_PORT") == "9464",
    }
    for name, good in ecs.items():
        (ok if good else fail)(f"ECS task definition: {name}")
    # Dockerfile.
    df = open(os.path.join(ROOT, "Dockerfile")).read()
    froms = re.findall(r"^FROM\s+(\S+)", df, re.M)
    docker = {
        "multi-stage": len(froms) >= 2,
        "pinned bases (no :latest, a version tag)": all(":" in f and not f.endswith(":latest") for f in froms),
        "distroless or equally small runtime": "distroless" in froms[-1],
        "non-root user": re.search(r"^USER\s+(nonroot|\d+)", df, re.M) is not None and not re.search(r"^USER\s+(root|0)\b", df, re.M),
        "cargo build --release --locked": "cargo build --release --locked" in df,
        "exec-form ENTRYPOINT (no shell at run time)": re.search(r'^ENTRYPOINT\s+\[', df, re.M) is not None,
        "metrics port exposed": "EXPOSE 9464" in df,
        ".dockerignore": os.path.exists(os.path.join(ROOT, ".dockerignore")),
    }
    for name, good in docker.items():
        (ok if good else fail)(f"Dockerfile: {name}")


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
        except Exception:
            pass
        time.sleep(0.5)
    raise SystemExit(f"check-deploy: timed out waiting for {what}")


def live(work, binary, aws_python):
    ddb_port, sqs_port = os.environ["DDB_LOCAL_PORT"], os.environ["SQS_LOCAL_PORT"]
    suffix = f"{os.getpid()}"
    table, state, queue = f"deploycheck-{suffix}", f"deploycheck-state-{suffix}", f"deploycheck-dlq-{suffix}"
    env = dict(os.environ, AWS_REGION="us-east-1", AWS_ACCESS_KEY_ID="local", AWS_SECRET_ACCESS_KEY="local",
               AWS_ENDPOINT_URL_DYNAMODB=f"http://127.0.0.1:{ddb_port}", AWS_ENDPOINT_URL_DYNAMODB_STREAMS=f"http://127.0.0.1:{ddb_port}",
               AWS_ENDPOINT_URL_SQS=f"http://127.0.0.1:{sqs_port}", DEMO_TABLE=table, DEMO_STATE=state, DEMO_QUEUE=queue)
    data = lambda *a: subprocess.run([aws_python, os.path.join(ROOT, "scripts/demo_data.py"), *a], env=env, check=True, stdout=subprocess.DEVNULL)
    data("setup")
    metrics_port, prom_port = free_port(), free_port()
    svc_env = dict(env, DDB_AGGREGATOR__SOURCE__TABLE=table, DDB_AGGREGATOR__AGGREGATES__TABLE=table, DDB_AGGREGATOR__STATE__TABLE=state,
                   DDB_AGGREGATOR__STATE__LEASE_DURATION="2s", DDB_AGGREGATOR__RECONCILE__INTERVAL="2s",
                   DDB_AGGREGATOR__DEAD_LETTER__QUEUE_URL=f"http://127.0.0.1:{sqs_port}/000000000000/{queue}",
                   DDB_AGGREGATOR__METRICS__LISTEN=f"127.0.0.1:{metrics_port}")
    log = open(os.path.join(work, "service.log"), "w")
    svc = subprocess.Popen([binary, "run", "--config", os.path.join(ROOT, "config/commerce.yaml")], env=svc_env, stdout=log, stderr=log)
    prom_cfg = os.path.join(work, "prometheus.yml")
    with open(prom_cfg, "w") as f:
        yaml.safe_dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                        "scrape_configs": [{"job_name": "ddb-aggregator", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}]}, f)
    prom = subprocess.Popen(["prometheus", f"--config.file={prom_cfg}", f"--storage.tsdb.path={work}/tsdb", f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "prometheus.log"), "w"))
    try:
        wait_until("the service's /readyz", lambda: "ready" in http_get(f"http://127.0.0.1:{metrics_port}/readyz"), 60)
        wait_until("Prometheus", lambda: http_get(f"http://127.0.0.1:{prom_port}/-/ready") != "", 60)
        data("write")
        data("poison")
        wait_until("the aggregates", lambda: subprocess.run([aws_python, os.path.join(ROOT, "scripts/demo_data.py"), "show", "--check"], env=env).returncode == 0, 60)
        data("drift")
        # The schedule (every 2 s) reconciles c1, which the drift's order touched.
        wait_until("a scheduled reconcile with a correction",
                   lambda: re.search(r"^ddb_aggregator_reconcile_corrections_total\{rule=\"customer-orders\"\} [1-9]", http_get(f"http://127.0.0.1:{metrics_port}/metrics"), re.M), 60)
        # ... and finishes with no drift left (the gauge the reconcile-not-succeeding alert reads).
        wait_until("a scheduled reconcile that finished with no drift left",
                   lambda: re.search(r"^ddb_aggregator_reconcile_last_success_timestamp_seconds [0-9]", http_get(f"http://127.0.0.1:{metrics_port}/metrics"), re.M), 120)
        wait_until("a dead letter", lambda: re.search(r'^ddb_aggregator_dead_letters_total\{reason="non_numeric_sum"\} 1', http_get(f"http://127.0.0.1:{metrics_port}/metrics"), re.M), 60)
        time.sleep(8)  # several scrapes, so rate() and increase() have samples
        text = http_get(f"http://127.0.0.1:{metrics_port}/metrics")
        open(os.path.join(work, "metrics.txt"), "w").write(text)
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        if lint.returncode != 0 or lint.stdout.strip() or lint.stderr.strip():
            fail(f"promtool check metrics: {lint.stdout}{lint.stderr}")
        else:
            ok(f"promtool check metrics: no problems in {len(text.splitlines())} lines of live /metrics")
        # Every PromQL expression of the dashboard and the alerts, through the HTTP API.
        def query(expr):
            url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
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
            fail(f"dashboard: variables job, namespace and instance expected, found {sorted(names)}")
        for panel in dash["panels"]:
            for t in panel["targets"]:
                expr = t["expr"]
                for k, v in variables.items():
                    expr = expr.replace(k, v)
                if "$" in expr:
                    fail(f"dashboard '{panel['title']}' {t['refId']}: unknown variable in {t['expr']}")
                    continue
                r = query(expr)
                if r.get("status") != "success":
                    fail(f"dashboard '{panel['title']}' {t['refId']}: {r.get('error')}")
                elif not r["data"]["result"]:
                    fail(f"dashboard '{panel['title']}' {t['refId']}: no data for {t['expr']}")
                else:
                    ok(f"dashboard '{panel['title']}' {t['refId']}: {len(r['data']['result'])} series")
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
                ok(f"alert {rule['alert']}: evaluates ({len(r['data']['result'])} firing, measured side {len(r2['data']['result'])} series)")
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
    p.add_argument("command", choices=["rules", "static", "live"])
    p.add_argument("--work")
    p.add_argument("--binary")
    p.add_argument("--aws-python")
    a = p.parse_args()
    {"rules": rules, "static": static, "live": lambda: live(a.work, a.binary, a.aws_python)}[a.command]()
    if FAILURES:
        print(f"check-deploy: {len(FAILURES)} problem(s)")
        sys.exit(1)


if __name__ == "__main__":
    main()

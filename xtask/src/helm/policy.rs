//! The promises the charts make about what they render: objects per case, the Deployment's
//! security context, probes, arguments and mounts, and the state encryption key Secret the
//! charts generate.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

use super::cases::{COMMON_FLAGS, Chart, SECRET_FLAGS};

/// The runtime user of the images, which the charts' security contexts must match.
const RUNTIME_UID: u64 = 65532;
/// Permission bits a Secret volume's files must not have: write, execute and read for others
/// (0440, read for the owner and the pod's fsGroup, is the widest the charts use).
const SECRET_MODE_FORBIDDEN: u64 = 0o337;
/// Bytes of one state encryption key (AES-256).
const STATE_KEY_LEN: usize = 32;

/// The promises the charts make about what they render.
pub(super) fn check_policy(chart: &Chart, case: &str, objects: &[Value]) -> Result<()> {
    // No case renders a Secret: the one the chart generates holds a random key, which a
    // snapshot cannot hold (check_generated_key covers it).
    let kinds: BTreeSet<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
    let expected: &[&str] = match (chart.name, case) {
        (_, "default") => &["Deployment", "Service", "ServiceAccount"],
        (_, "alerts") => &[
            "ConfigMap",
            "Deployment",
            "PrometheusRule",
            "Service",
            "ServiceAccount",
        ],
        (_, "ha") => &[
            "ConfigMap",
            "Deployment",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "PrometheusRule",
            "Role",
            "RoleBinding",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ],
        ("hetzner", _) => &[
            "ConfigMap",
            "Deployment",
            "NetworkPolicy",
            "PersistentVolumeClaim",
            "PrometheusRule",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
        ],
        _ => &[
            "ConfigMap",
            "Deployment",
            "NetworkPolicy",
            "PrometheusRule",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
        ],
    };
    ensure!(
        kinds == expected.iter().copied().collect(),
        "rendered kinds {kinds:?}, want {expected:?}"
    );

    let deployments: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "Deployment")
        .collect();
    ensure!(deployments.len() == 1, "want exactly one Deployment");
    let deployment = deployments[0];
    let args = check_deployment(chart, deployment)?;

    let services: Vec<&Value> = objects.iter().filter(|o| o["kind"] == "Service").collect();
    let main = services
        .iter()
        .find(|s| port_targets(s).contains("grpc"))
        .context("no Service targets the grpc port")?;
    ensure!(
        main["spec"]["type"] == "ClusterIP",
        "the gRPC Service must stay ClusterIP"
    );
    ensure!(
        port_targets(main).contains("metrics"),
        "the gRPC Service has no metrics port"
    );

    if args.iter().any(|(flag, _)| flag == "bootstrap-addr") {
        let bootstrap = services
            .iter()
            .find(|s| port_targets(s).contains("bootstrap"))
            .context("the agent channel is on but no Service publishes it")?;
        let kind = bootstrap["spec"]["type"].as_str().unwrap_or("ClusterIP");
        ensure!(
            kind == "LoadBalancer" || kind == "NodePort",
            "the agent channel Service is {kind}; Droplets outside the cluster could not reach it"
        );
        ensure!(
            !port_targets(bootstrap).contains("grpc"),
            "the public agent channel Service must not carry gRPC"
        );
    }

    if args
        .iter()
        .any(|(flag, value)| flag == "state" && value.starts_with("etcd://"))
    {
        check_ha(deployment, &args, &services, objects)?;
    }
    if case == "ha" {
        ensure!(
            args.iter().any(|(flag, _)| flag == "leader-label"),
            "the ha values do not pass --leader-label"
        );
        ensure!(
            deployment["spec"]["replicas"].as_u64() > Some(1),
            "the ha values run one replica"
        );
    }

    if case == "full" {
        for flag in [
            "admin-socket",
            "state",
            "tls-cert",
            "tls-ca",
            "offerings",
            "base-user-data",
            "state-encryption-key-file",
            "fail-unreadable-configures",
        ] {
            ensure!(
                args.iter().any(|(f, _)| f == flag),
                "full values do not pass --{flag}"
            );
        }
        let monitor = objects
            .iter()
            .find(|o| o["kind"] == "ServiceMonitor")
            .context("no ServiceMonitor")?;
        ensure!(
            monitor["spec"]["endpoints"][0]["port"] == "metrics",
            "the ServiceMonitor must scrape the metrics port"
        );
    }
    Ok(())
}

/// HA mode (the state in etcd): replicas rolled one at a time, Ready while warm, spread, no
/// volume for the state, a PodDisruptionBudget, and with the leader label the RBAC, the
/// downward-API environment and Services that route to the leader.
fn check_ha(
    deployment: &Value,
    args: &[(String, String)],
    services: &[&Value],
    objects: &[Value],
) -> Result<()> {
    let spec = &deployment["spec"];
    let pod = &spec["template"]["spec"];
    let pod_labels = &spec["template"]["metadata"]["labels"];
    let container = &pod["containers"][0];
    ensure!(
        spec["strategy"]["type"] == "RollingUpdate"
            && spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 1
            && spec["strategy"]["rollingUpdate"]["maxSurge"] == 1,
        "HA mode rolls one replica at a time (RollingUpdate, maxUnavailable 1, maxSurge 1)"
    );
    ensure!(
        container["readinessProbe"]["httpGet"]["path"] == "/readyz/replica",
        "HA mode's readiness probe must be /readyz/replica (warm standbys are Ready)"
    );
    let keys: BTreeSet<&str> = pod["topologySpreadConstraints"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["topologyKey"].as_str())
        .collect();
    ensure!(
        keys.contains("kubernetes.io/hostname") && keys.contains("topology.kubernetes.io/zone"),
        "HA mode spreads replicas across nodes and zones, got {keys:?}"
    );
    ensure!(
        !objects.iter().any(|o| o["kind"] == "PersistentVolumeClaim"),
        "HA mode keeps the state in etcd: no PersistentVolumeClaim"
    );
    let selects_pods = |selector: &Value| {
        selector
            .as_object()
            .is_some_and(|m| !m.is_empty() && m.iter().all(|(k, v)| pod_labels[k] == *v))
    };
    if spec["replicas"].as_u64() > Some(1) {
        let budget = objects
            .iter()
            .find(|o| o["kind"] == "PodDisruptionBudget")
            .context("HA mode with several replicas needs a PodDisruptionBudget")?;
        ensure!(
            budget["spec"]["maxUnavailable"] == 1,
            "the PodDisruptionBudget must allow one replica down (maxUnavailable 1)"
        );
        ensure!(
            selects_pods(&budget["spec"]["selector"]["matchLabels"]),
            "the PodDisruptionBudget does not select the replicas"
        );
    }
    let flag = |name: &str| {
        args.iter()
            .find(|(f, _)| f == name)
            .map(|(_, v)| v.as_str())
    };
    ensure!(
        flag("state-encryption-key-file").is_some(),
        "HA mode needs --state-encryption-key-file: without it every takeover fails the Configures in flight"
    );
    for tls in ["etcd-ca", "etcd-cert", "etcd-key"] {
        if let Some(path) = flag(tls) {
            ensure!(
                path.starts_with("/etc/bigfleet/etcd/"),
                "--{tls}={path} is not on the etcd TLS Secret's mount"
            );
        }
    }
    if flag("leader-label").is_none() {
        return Ok(());
    }
    for service in services {
        if port_targets(service).contains("grpc") || port_targets(service).contains("bootstrap") {
            ensure!(
                service["spec"]["selector"]["bigfleet-leader"] == "true",
                "Service {} must select the leader (bigfleet-leader: \"true\")",
                service["metadata"]["name"]
            );
        }
    }
    ensure!(
        pod["automountServiceAccountToken"] == true,
        "the leader label needs the pod's service account token"
    );
    for (name, field) in [
        ("BIGFLEET_POD_NAME", "metadata.name"),
        ("BIGFLEET_POD_NAMESPACE", "metadata.namespace"),
    ] {
        ensure!(
            container["env"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|e| { e["name"] == name && e["valueFrom"]["fieldRef"]["fieldPath"] == field }),
            "{name} must come from the downward API ({field})"
        );
    }
    let role = objects
        .iter()
        .find(|o| o["kind"] == "Role")
        .context("the leader label needs a Role")?;
    let rules = role["rules"].as_array().context("Role without rules")?;
    ensure!(
        rules.iter().any(|r| {
            let has = |field: &str, want: &str| {
                r[field]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|v| v == want))
            };
            has("apiGroups", "") && has("resources", "pods") && has("verbs", "patch")
        }),
        "the Role must allow patch on pods"
    );
    ensure!(
        rules.iter().all(|r| r["verbs"]
            .as_array()
            .is_some_and(|a| a.iter().all(|v| v == "patch"))),
        "the Role grants more than patch (the leader label needs nothing else)"
    );
    ensure!(
        rules.iter().all(|r| r["resources"]
            .as_array()
            .is_some_and(|a| a.iter().all(|v| v == "pods"))),
        "the Role grants more than pods"
    );
    let binding = objects
        .iter()
        .find(|o| o["kind"] == "RoleBinding")
        .context("the leader label needs a RoleBinding")?;
    ensure!(
        binding["roleRef"]["name"] == role["metadata"]["name"]
            && binding["subjects"][0]["name"] == pod["serviceAccountName"],
        "the RoleBinding must bind the Role to the pod's service account"
    );
    check_leader_label_policy(objects, pod)?;
    if let Some(policy) = objects.iter().find(|o| o["kind"] == "NetworkPolicy")
        && let Some(egress) = policy["spec"]["egress"].as_array()
    {
        let ports: BTreeSet<u64> = egress
            .iter()
            .flat_map(|rule| rule["ports"].as_array().cloned().unwrap_or_default())
            .filter_map(|p| p["port"].as_u64())
            .collect();
        ensure!(
            ports.contains(&2379) && ports.contains(&443),
            "the NetworkPolicy must let the replicas reach etcd and the Kubernetes API, egress ports {ports:?}"
        );
    }
    Ok(())
}

fn port_targets(service: &Value) -> BTreeSet<String> {
    service["spec"]["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|port| port["targetPort"].as_str().map(str::to_owned))
        .collect()
}

/// Checks the Deployment and returns its container's `--flag=value` arguments.
fn check_deployment(chart: &Chart, deployment: &Value) -> Result<Vec<(String, String)>> {
    let spec = &deployment["spec"];
    let replicated = spec["strategy"]["type"] == "RollingUpdate";
    ensure!(
        replicated || spec["strategy"]["type"] == "Recreate",
        "the strategy must be Recreate (or RollingUpdate in HA mode)"
    );
    if !replicated {
        ensure!(
            spec["replicas"] == 1,
            "replicas must be 1 with a local state"
        );
    }
    let pod = &spec["template"]["spec"];
    let pod_security = &pod["securityContext"];
    ensure!(
        pod_security["runAsNonRoot"] == true,
        "pod must run as non-root"
    );
    ensure!(
        pod_security["runAsUser"] == RUNTIME_UID,
        "pod must run as uid {RUNTIME_UID}"
    );
    ensure!(
        pod_security["seccompProfile"]["type"] == "RuntimeDefault",
        "pod seccomp must be RuntimeDefault"
    );

    let containers = pod["containers"].as_array().context("no containers")?;
    ensure!(containers.len() == 1, "want exactly one container");
    let container = &containers[0];
    let security = &container["securityContext"];
    ensure!(
        security["readOnlyRootFilesystem"] == true,
        "root filesystem must be read-only"
    );
    ensure!(
        security["allowPrivilegeEscalation"] == false,
        "privilege escalation must be off"
    );
    let dropped = security["capabilities"]["drop"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    ensure!(
        dropped.iter().any(|c| c == "ALL"),
        "all capabilities must be dropped"
    );
    ensure!(
        security["capabilities"]["add"].is_null(),
        "no capability may be added"
    );

    let args = container_args(chart, container)?;
    let flag = |name: &str| {
        args.iter()
            .find(|(f, _)| f == name)
            .map(|(_, v)| v.as_str())
    };
    let ports = named_ports(container);
    for (port_flag, port_name) in [
        ("addr", "grpc"),
        ("metrics-addr", "metrics"),
        ("bootstrap-addr", "bootstrap"),
    ] {
        if let Some(addr) = flag(port_flag) {
            let port: u64 = addr
                .rsplit(':')
                .next()
                .unwrap_or_default()
                .parse()
                .with_context(|| format!("--{port_flag}={addr}"))?;
            ensure!(
                ports.get(port_name) == Some(&port),
                "--{port_flag}={addr} but container port {port_name} is {:?}",
                ports.get(port_name)
            );
        }
    }
    let readiness = if replicated {
        "/readyz/replica"
    } else {
        "/readyz"
    };
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", readiness)] {
        let get = &container[probe]["httpGet"];
        ensure!(
            get["path"] == path && get["port"] == "metrics",
            "{probe} must GET {path} on the metrics port"
        );
    }
    for needs_state in ["state-encryption-key-file", "fail-unreadable-configures"] {
        ensure!(
            flag(needs_state).is_none() || flag("state").is_some(),
            "--{needs_state} without --state: the binary refuses it, there is no state to seal into"
        );
    }
    if replicated {
        ensure!(
            flag("state").is_some_and(|s| s.starts_with("etcd://")),
            "a RollingUpdate needs the state in etcd: two processes on one local state would both own it"
        );
    }

    let grace =
        go_duration_seconds(flag("shutdown-grace").context("--shutdown-grace is not set")?)?;
    let termination = pod["terminationGracePeriodSeconds"]
        .as_f64()
        .context("terminationGracePeriodSeconds is not set")?;
    ensure!(
        termination > grace,
        "terminationGracePeriodSeconds ({termination}) must exceed --shutdown-grace ({grace}s)"
    );

    for env in container["env"].as_array().into_iter().flatten() {
        let name = env["name"].as_str().unwrap_or_default();
        if chart.secret_env.contains(&name) {
            ensure!(env["value"].is_null(), "{name} must not be a literal value");
            ensure!(
                !env["valueFrom"]["secretKeyRef"].is_null(),
                "{name} must come from a Secret"
            );
        }
    }

    check_mounts(chart, pod, container, &args)?;
    Ok(args)
}

fn named_ports(container: &Value) -> std::collections::BTreeMap<String, u64> {
    container["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| Some((p["name"].as_str()?.to_owned(), p["containerPort"].as_u64()?)))
        .collect()
}

/// Splits the container's arguments into (flag, value) and refuses unknown or secret flags.
fn container_args(chart: &Chart, container: &Value) -> Result<Vec<(String, String)>> {
    ensure!(
        container["command"].is_null(),
        "the chart must keep the image entrypoint"
    );
    let mut args = Vec::new();
    for arg in container["args"].as_array().context("no args")? {
        let arg = arg.as_str().context("an argument is not a string")?;
        let flag = arg
            .strip_prefix("--")
            .with_context(|| format!("argument {arg:?} is not a --flag"))?;
        let (name, value) = flag.split_once('=').unwrap_or((flag, ""));
        ensure!(
            !SECRET_FLAGS.contains(&name),
            "--{name} would put a secret in the pod spec"
        );
        ensure!(
            COMMON_FLAGS.contains(&name) || chart.flags.contains(&name),
            "--{name} is not a flag of the {} binary",
            chart.name
        );
        args.push((name.to_owned(), value.to_owned()));
    }
    Ok(args)
}

/// Every path flag points into a mounted volume; state and admin socket are writable;
/// every mount has a volume and every volume is mounted.
fn check_mounts(
    chart: &Chart,
    pod: &Value,
    container: &Value,
    args: &[(String, String)],
) -> Result<()> {
    let volumes: Vec<&Value> = pod["volumes"].as_array().into_iter().flatten().collect();
    let mounts: Vec<&Value> = container["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    let volume_names: BTreeSet<&str> = volumes.iter().filter_map(|v| v["name"].as_str()).collect();
    let mounted: BTreeSet<&str> = mounts.iter().filter_map(|m| m["name"].as_str()).collect();
    ensure!(
        volume_names == mounted,
        "volumes {volume_names:?} and mounts {mounted:?} differ"
    );
    for volume in volumes.iter().filter(|v| !v["secret"].is_null()) {
        let name = volume["name"].as_str().unwrap_or_default();
        ensure!(
            mounts
                .iter()
                .filter(|m| m["name"] == name)
                .all(|m| m["readOnly"] == true),
            "Secret volume {name} must be mounted read-only"
        );
        let mode = volume["secret"]["defaultMode"]
            .as_u64()
            .with_context(|| format!("Secret volume {name} has no defaultMode"))?;
        let item_modes = volume["secret"]["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|item| item["mode"].as_u64());
        for mode in std::iter::once(mode).chain(item_modes) {
            ensure!(
                mode & SECRET_MODE_FORBIDDEN == 0,
                "Secret volume {name} has mode {mode:#o}; at most 0440 (no write, execute or others)"
            );
        }
    }

    for (flag, value) in args.iter().filter(|(flag, value)| {
        chart.path_flags.contains(&flag.as_str())
            && !(flag == "state" && value.starts_with("etcd://"))
    }) {
        let mount = mounts
            .iter()
            .filter(|m| {
                m["mountPath"]
                    .as_str()
                    .is_some_and(|dir| Path::new(value).starts_with(dir))
            })
            .max_by_key(|m| m["mountPath"].as_str().map_or(0, str::len))
            .with_context(|| format!("--{flag}={value} is not inside any mounted volume"))?;
        if flag == "state" || flag == "admin-socket" {
            ensure!(
                mount["readOnly"] != true,
                "--{flag}={value} lies on a read-only mount"
            );
        }
        if flag == "state-encryption-key-file" {
            let volume = volumes
                .iter()
                .find(|v| v["name"] == mount["name"])
                .context("state encryption key volume")?;
            ensure!(
                !volume["secret"].is_null(),
                "--{flag}={value} must come from a Secret volume"
            );
        }
        if flag == "admin-socket" {
            let volume = volumes
                .iter()
                .find(|v| v["name"] == mount["name"])
                .context("admin socket volume")?;
            ensure!(
                !volume["emptyDir"].is_null(),
                "the admin socket must live on an emptyDir"
            );
        }
    }
    Ok(())
}

/// The render of a chart that generates its state encryption key: the Deployment keeps its
/// promises and mounts the one Secret, which survives an uninstall and holds a key file the
/// binary accepts. Returns the key file, for comparing renders.
pub(super) fn check_generated_key(chart: &Chart, objects: &[Value]) -> Result<String> {
    let deployment = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .context("no Deployment")?;
    let args = check_deployment(chart, deployment)?;
    let path = args
        .iter()
        .find(|(f, _)| f == "state-encryption-key-file")
        .map(|(_, v)| v.as_str())
        .context(
            "a state with stateEncryption.enabled does not pass --state-encryption-key-file",
        )?;
    let pod = &deployment["spec"]["template"]["spec"];
    let (dir, file) = path
        .rsplit_once('/')
        .with_context(|| format!("--state-encryption-key-file={path}"))?;
    let mount = pod["containers"][0]["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["mountPath"] == dir)
        .with_context(|| format!("nothing is mounted at {dir}"))?;
    let volume = pod["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == mount["name"])
        .context("the key mount has no volume")?;
    let item = volume["secret"]["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|item| item["path"] == file)
        .with_context(|| format!("the key volume has no item {file}"))?;
    let key = item["key"].as_str().context("item without a key")?;

    let secrets: Vec<&Value> = objects.iter().filter(|o| o["kind"] == "Secret").collect();
    ensure!(
        secrets.len() == 1,
        "want exactly one Secret, the generated key"
    );
    let secret = secrets[0];
    ensure!(
        secret["metadata"]["name"] == volume["secret"]["secretName"],
        "the key volume mounts {}, the chart generates {}",
        volume["secret"]["secretName"],
        secret["metadata"]["name"]
    );
    ensure!(
        secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep",
        "the generated key Secret needs helm.sh/resource-policy: keep, or an uninstall loses the key of the Configures in flight"
    );
    let data = secret["data"][key]
        .as_str()
        .with_context(|| format!("the generated Secret has no {key}"))?;
    let text = String::from_utf8(base64_decode(data).context("the Secret's data")?)
        .context("the key file is not text")?;
    let mut count = 0;
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bytes = base64_decode(line).context("a key file line is not base64")?;
        ensure!(
            bytes.len() == STATE_KEY_LEN,
            "a generated key is {} bytes, want {STATE_KEY_LEN}",
            bytes.len()
        );
        count += 1;
    }
    ensure!(count >= 1, "the generated key file holds no key");
    Ok(text)
}

/// Standard base64 with padding, as Kubernetes Secret data and `openssl rand -base64` write it.
fn base64_decode(text: &str) -> Result<Vec<u8>> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes = text.trim().as_bytes();
    ensure!(
        bytes.len().is_multiple_of(4),
        "base64 of {} characters is not padded",
        bytes.len()
    );
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    for (index, chunk) in bytes.chunks(4).enumerate() {
        let last = index + 1 == bytes.len() / 4;
        let padding = chunk.iter().rev().take_while(|&&c| c == b'=').count();
        ensure!(
            padding <= 2 && (padding == 0 || last),
            "misplaced base64 padding"
        );
        let mut word = 0u32;
        for &c in &chunk[..4 - padding] {
            let value = ALPHABET
                .iter()
                .position(|&a| a == c)
                .with_context(|| format!("{:?} is not a base64 character", c as char))?;
            word = (word << 6) | value as u32;
        }
        word <<= 6 * padding as u32;
        let decoded = word.to_be_bytes();
        out.extend_from_slice(&decoded[1..4 - padding]);
    }
    Ok(out)
}

/// Seconds in a Go duration such as `25s`, `1m30s` or `1.5h`.
fn go_duration_seconds(text: &str) -> Result<f64> {
    if text == "0" {
        return Ok(0.0);
    }
    let mut total = 0.0;
    let mut rest = text;
    ensure!(!rest.is_empty(), "empty duration");
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..number_len]
            .parse()
            .with_context(|| format!("bad duration {text:?}"))?;
        rest = &rest[number_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            unit => bail!("bad unit {unit:?} in duration {text:?}"),
        };
        rest = &rest[unit_len..];
        total += number * scale;
    }
    Ok(total)
}

/// The ValidatingAdmissionPolicy that narrows the Role: bound with Deny in the release's
/// namespace, failing closed, matching pod updates by the pod's own service account only. What
/// its expressions admit is evaluated apart (`chartcheck.py admission-cases`).
fn check_leader_label_policy(objects: &[Value], pod: &Value) -> Result<()> {
    let policy = objects
        .iter()
        .find(|o| o["kind"] == "ValidatingAdmissionPolicy")
        .context("the leader label needs its ValidatingAdmissionPolicy (ha.leaderLabelPolicy)")?;
    let spec = &policy["spec"];
    ensure!(
        spec["failurePolicy"] == "Fail",
        "the leader-label policy must fail closed"
    );
    let rules = spec["matchConstraints"]["resourceRules"]
        .as_array()
        .context("the leader-label policy matches no resources")?;
    ensure!(
        rules
            .iter()
            .any(|r| r["resources"] == serde_json::json!(["pods"])
                && r["operations"] == serde_json::json!(["UPDATE"])),
        "the leader-label policy must match pod updates"
    );
    let account = pod["serviceAccountName"]
        .as_str()
        .context("pod without a service account")?;
    let conditions = spec["matchConditions"].to_string();
    ensure!(
        conditions.contains(&format!(
            "system:serviceaccount:{}:{account}",
            super::NAMESPACE
        )),
        "the leader-label policy must match the provider's own service account"
    );
    let binding = objects
        .iter()
        .find(|o| o["kind"] == "ValidatingAdmissionPolicyBinding")
        .context("the leader-label policy needs a binding")?;
    ensure!(
        binding["spec"]["policyName"] == policy["metadata"]["name"]
            && binding["spec"]["validationActions"] == serde_json::json!(["Deny"]),
        "the leader-label policy binding must bind the policy with Deny"
    );
    ensure!(
        binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
            == super::NAMESPACE,
        "the leader-label policy binding must select the release's namespace"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::helm::cases::CHARTS;
    use serde_json::json;

    #[test]
    fn go_durations() {
        assert_eq!(go_duration_seconds("25s").unwrap(), 25.0);
        assert_eq!(go_duration_seconds("1m30s").unwrap(), 90.0);
        assert_eq!(go_duration_seconds("1.5h").unwrap(), 5400.0);
        assert_eq!(go_duration_seconds("0").unwrap(), 0.0);
        assert!((go_duration_seconds("250ms").unwrap() - 0.25).abs() < 1e-9);
        for bad in ["", "25", "5 min", "m5", "3d"] {
            assert!(go_duration_seconds(bad).is_err(), "{bad:?}");
        }
    }

    /// A Deployment the policy accepts; tests break one thing at a time.
    fn good_deployment() -> Value {
        json!({
            "kind": "Deployment",
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},
                "template": {"spec": {
                    "terminationGracePeriodSeconds": 30,
                    "securityContext": {"runAsNonRoot": true, "runAsUser": 65532,
                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "volumes": [
                        {"name": "state", "emptyDir": {}},
                        {"name": "admin", "emptyDir": {"medium": "Memory"}},
                        {"name": "tls", "secret": {"secretName": "t", "defaultMode": 0o440}}
                    ],
                    "containers": [{
                        "name": "provider",
                        "args": ["--addr=:9000", "--metrics-addr=:9090", "--shutdown-grace=25s",
                                 "--state=/var/lib/x/state.json", "--admin-socket=/run/bigfleet/admin.sock",
                                 "--tls-cert=/etc/bigfleet/tls/tls.crt"],
                        "env": [{"name": "HCLOUD_TOKEN",
                                 "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}}],
                        "ports": [{"name": "grpc", "containerPort": 9000},
                                  {"name": "metrics", "containerPort": 9090}],
                        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "metrics"}},
                        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"}},
                        "securityContext": {"readOnlyRootFilesystem": true,
                            "allowPrivilegeEscalation": false,
                            "capabilities": {"drop": ["ALL"]}},
                        "volumeMounts": [
                            {"name": "state", "mountPath": "/var/lib/x"},
                            {"name": "admin", "mountPath": "/run/bigfleet"},
                            {"name": "tls", "mountPath": "/etc/bigfleet/tls", "readOnly": true}
                        ]
                    }]
                }}
            }
        })
    }

    fn verdict(edit: impl FnOnce(&mut Value)) -> Result<Vec<(String, String)>> {
        let mut deployment = good_deployment();
        edit(&mut deployment);
        check_deployment(&CHARTS[0], &deployment)
    }

    fn container(deployment: &mut Value) -> &mut Value {
        &mut deployment["spec"]["template"]["spec"]["containers"][0]
    }

    #[test]
    fn the_good_deployment_passes() {
        let args = verdict(|_| {}).unwrap();
        assert!(args.contains(&("shutdown-grace".to_owned(), "25s".to_owned())));
    }

    #[test]
    fn each_broken_promise_is_caught() {
        type Edit = fn(&mut Value);
        let cases: &[(&str, Edit)] = &[
            ("two replicas", |d| d["spec"]["replicas"] = json!(2)),
            ("rolling update", |d| {
                d["spec"]["strategy"]["type"] = json!("RollingUpdate")
            }),
            ("root user", |d| {
                d["spec"]["template"]["spec"]["securityContext"]["runAsUser"] = json!(0)
            }),
            ("writable root", |d| {
                container(d)["securityContext"]["readOnlyRootFilesystem"] = json!(false)
            }),
            ("escalation", |d| {
                container(d)["securityContext"]["allowPrivilegeEscalation"] = json!(true)
            }),
            ("added capability", |d| {
                container(d)["securityContext"]["capabilities"]["add"] = json!(["NET_ADMIN"])
            }),
            ("short grace", |d| {
                d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = json!(20)
            }),
            ("token flag", |d| {
                container(d)["args"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!("--token=abc"))
            }),
            ("unknown flag", |d| {
                container(d)["args"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!("--regoin=x"))
            }),
            ("other binary's flag", |d| {
                container(d)["args"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!("--region=nyc3"))
            }),
            ("literal token", |d| {
                container(d)["env"][0] = json!({"name": "HCLOUD_TOKEN", "value": "abc"})
            }),
            ("wrong probe", |d| {
                container(d)["readinessProbe"]["httpGet"]["path"] = json!("/healthz")
            }),
            ("port mismatch", |d| {
                container(d)["ports"][0]["containerPort"] = json!(9001)
            }),
            ("read-only state", |d| {
                container(d)["volumeMounts"][0]["readOnly"] = json!(true)
            }),
            ("unmounted file", |d| {
                container(d)["args"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!("--tls-ca=/etc/ca.crt"))
            }),
            ("admin socket off emptyDir", |d| {
                d["spec"]["template"]["spec"]["volumes"][1] =
                    json!({"name": "admin", "secret": {"secretName": "x"}})
            }),
            ("orphan volume", |d| {
                d["spec"]["template"]["spec"]["volumes"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"name": "x", "emptyDir": {}}))
            }),
            ("command override", |d| {
                container(d)["command"] = json!(["/bin/sh"])
            }),
            ("writable Secret mount", |d| {
                container(d)["volumeMounts"][2]["readOnly"] = json!(false)
            }),
            ("world-readable Secret", |d| {
                d["spec"]["template"]["spec"]["volumes"][2]["secret"]["defaultMode"] = json!(0o444)
            }),
            ("Secret without a mode", |d| {
                d["spec"]["template"]["spec"]["volumes"][2]["secret"]
                    .as_object_mut()
                    .unwrap()
                    .remove("defaultMode");
            }),
            ("writable Secret item", |d| {
                d["spec"]["template"]["spec"]["volumes"][2]["secret"]["items"] =
                    json!([{"key": "tls.crt", "path": "tls.crt", "mode": 0o640}])
            }),
            ("key file without a state", |d| {
                let args = container(d)["args"].as_array_mut().unwrap();
                args.retain(|a| !a.as_str().unwrap().starts_with("--state="));
                args.push(json!("--state-encryption-key-file=/etc/bigfleet/tls/keys"));
            }),
            ("failing unreadable Configures without a state", |d| {
                let args = container(d)["args"].as_array_mut().unwrap();
                args.retain(|a| !a.as_str().unwrap().starts_with("--state="));
                args.push(json!("--fail-unreadable-configures=true"));
            }),
            ("key file off a Secret", |d| {
                container(d)["args"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!("--state-encryption-key-file=/var/lib/x/keys"))
            }),
        ];
        for (what, edit) in cases {
            assert!(verdict(edit).is_err(), "{what} was accepted");
        }
    }

    /// A rendered HA release (the objects `check_ha` looks at), leader label on.
    fn ha_objects() -> Vec<Value> {
        let mut deployment = good_deployment();
        let spec = &mut deployment["spec"];
        spec["replicas"] = json!(3);
        spec["strategy"] = json!({"type": "RollingUpdate",
            "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 1}});
        spec["template"]["metadata"] = json!({"labels": {"app.kubernetes.io/name": "p"}});
        let pod = &mut spec["template"]["spec"];
        pod["serviceAccountName"] = json!("sa");
        pod["automountServiceAccountToken"] = json!(true);
        pod["topologySpreadConstraints"] = json!([
            {"topologyKey": "kubernetes.io/hostname"},
            {"topologyKey": "topology.kubernetes.io/zone"}
        ]);
        let container = &mut pod["containers"][0];
        container["args"] = json!([
            "--addr=:9000",
            "--metrics-addr=:9090",
            "--shutdown-grace=25s",
            "--state=etcd://e:2379/bigfleet/p",
            "--leader-label",
            "--state-encryption-key-file=/etc/bigfleet/state-key/keys"
        ]);
        container["readinessProbe"]["httpGet"]["path"] = json!("/readyz/replica");
        container["env"] = json!([
            {"name": "BIGFLEET_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "BIGFLEET_POD_NAMESPACE",
             "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}
        ]);
        container["volumeMounts"] = json!([
            {"name": "state-key", "mountPath": "/etc/bigfleet/state-key", "readOnly": true}
        ]);
        pod["volumes"] = json!([{"name": "state-key", "secret": {"secretName": "k",
            "defaultMode": 0o440, "items": [{"key": "keys", "path": "keys"}]}}]);
        vec![
            deployment,
            json!({"kind": "Service", "metadata": {"name": "p"}, "spec": {"type": "ClusterIP",
                "selector": {"app.kubernetes.io/name": "p", "bigfleet-leader": "true"},
                "ports": [{"targetPort": "grpc"}, {"targetPort": "metrics"}]}}),
            json!({"kind": "ServiceAccount"}),
            json!({"kind": "PodDisruptionBudget", "spec": {"maxUnavailable": 1,
                "selector": {"matchLabels": {"app.kubernetes.io/name": "p"}}}}),
            json!({"kind": "Role", "metadata": {"name": "r"}, "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]}),
            json!({"kind": "RoleBinding", "roleRef": {"name": "r"},
                "subjects": [{"kind": "ServiceAccount", "name": "sa"}]}),
            json!({"kind": "ValidatingAdmissionPolicy", "metadata": {"name": "v"}, "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                    "operations": ["UPDATE"], "resources": ["pods"]}]},
                "matchConditions": [{"name": "sa", "expression":
                    "request.userInfo.username == 'system:serviceaccount:bigfleet:sa'"}],
                "validations": [{"expression": "true"}]}}),
            json!({"kind": "ValidatingAdmissionPolicyBinding", "spec": {"policyName": "v",
                "validationActions": ["Deny"], "matchResources": {"namespaceSelector":
                    {"matchLabels": {"kubernetes.io/metadata.name": "bigfleet"}}}}}),
        ]
    }

    #[test]
    fn each_broken_ha_promise_is_caught() {
        let objects = ha_objects();
        let check = |objects: &[Value]| {
            let deployment = &objects[0];
            let args = check_deployment(&CHARTS[0], deployment)?;
            let services: Vec<&Value> = objects.iter().filter(|o| o["kind"] == "Service").collect();
            check_ha(deployment, &args, &services, objects)
        };
        check(&objects).unwrap();
        type Edit = fn(&mut Vec<Value>);
        let cases: &[(&str, Edit)] = &[
            ("all replicas at once", |o| {
                o[0]["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] = json!(3)
            }),
            ("readiness only on the leader", |o| {
                o[0]["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] =
                    json!("/readyz")
            }),
            ("no zone spread", |o| {
                o[0]["spec"]["template"]["spec"]["topologySpreadConstraints"]
                    .as_array_mut()
                    .unwrap()
                    .pop();
            }),
            ("a state volume", |o| {
                o.push(json!({"kind": "PersistentVolumeClaim"}))
            }),
            ("no budget", |o| {
                o.retain(|x| x["kind"] != "PodDisruptionBudget")
            }),
            ("a budget that blocks", |o| {
                o[3]["spec"]["maxUnavailable"] = json!(0)
            }),
            ("the Service reaches standbys", |o| {
                o[1]["spec"]["selector"]
                    .as_object_mut()
                    .unwrap()
                    .remove("bigfleet-leader");
            }),
            ("no token", |o| {
                o[0]["spec"]["template"]["spec"]["automountServiceAccountToken"] = json!(false)
            }),
            ("no pod name", |o| {
                o[0]["spec"]["template"]["spec"]["containers"][0]["env"]
                    .as_array_mut()
                    .unwrap()
                    .remove(0);
            }),
            ("no patch", |o| o[4]["rules"][0]["verbs"] = json!(["get"])),
            ("more than patch", |o| {
                o[4]["rules"][0]["verbs"] = json!(["get", "patch"])
            }),
            ("more than pods", |o| {
                o[4]["rules"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}))
            }),
            ("bound to another account", |o| {
                o[5]["subjects"][0]["name"] = json!("other")
            }),
            ("no admission policy", |o| {
                o.retain(|x| x["kind"] != "ValidatingAdmissionPolicy")
            }),
            ("an admission policy that fails open", |o| {
                o[6]["spec"]["failurePolicy"] = json!("Ignore")
            }),
            ("an admission policy for another account", |o| {
                o[6]["spec"]["matchConditions"][0]["expression"] =
                    json!("request.userInfo.username == 'system:serviceaccount:bigfleet:other'")
            }),
            ("an admission policy that only warns", |o| {
                o[7]["spec"]["validationActions"] = json!(["Warn"])
            }),
            ("an admission policy bound to another namespace", |o| {
                o[7]["spec"]["matchResources"]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] =
                    json!("default")
            }),
            ("no state encryption", |o| {
                o[0]["spec"]["template"]["spec"]["containers"][0]["args"]
                    .as_array_mut()
                    .unwrap()
                    .pop();
            }),
            ("a rolling update on a local state", |o| {
                o[0]["spec"]["template"]["spec"]["containers"][0]["args"][3] =
                    json!("--state=/var/lib/x/state.json")
            }),
        ];
        for (what, edit) in cases {
            let mut broken = objects.clone();
            edit(&mut broken);
            assert!(check(&broken).is_err(), "{what} was not caught");
        }
    }

    #[test]
    fn base64_as_kubernetes_writes_it() {
        assert_eq!(base64_decode("").unwrap(), b"");
        assert_eq!(base64_decode("eA==").unwrap(), b"x");
        assert_eq!(base64_decode("eHk=").unwrap(), b"xy");
        assert_eq!(base64_decode("eHl6").unwrap(), b"xyz");
        assert_eq!(
            base64_decode("YWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWE=").unwrap(),
            [b'a'; 32]
        );
        for bad in ["eA", "e===", "eA==eA==", "e!A="] {
            assert!(base64_decode(bad).is_err(), "{bad:?}");
        }
    }

    /// A rendered release whose chart generated the key Secret.
    fn generated_key_objects() -> Vec<Value> {
        let mut deployment = good_deployment();
        let pod = &mut deployment["spec"]["template"]["spec"];
        pod["volumes"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "state-key",
            "secret": {"secretName": "r-state-key", "defaultMode": 0o440,
                "items": [{"key": "keys", "path": "keys"}]}}));
        let container = &mut pod["containers"][0];
        container["args"].as_array_mut().unwrap().push(json!(
            "--state-encryption-key-file=/etc/bigfleet/state-key/keys"
        ));
        container["volumeMounts"]
            .as_array_mut()
            .unwrap()
            .push(json!(
            {"name": "state-key", "mountPath": "/etc/bigfleet/state-key", "readOnly": true}));
        // "YWFh...YWE=\n": the key file of one key, `a` 32 times.
        vec![
            deployment,
            json!({"kind": "Secret", "metadata": {"name": "r-state-key",
                "annotations": {"helm.sh/resource-policy": "keep"}},
                "data": {"keys": "WVdGaFlXRmhZV0ZoWVdGaFlXRmhZV0ZoWVdGaFlXRmhZV0ZoWVdGaFlXRT0K"}}),
        ]
    }

    #[test]
    fn each_broken_generated_key_promise_is_caught() {
        let objects = generated_key_objects();
        assert_eq!(
            check_generated_key(&CHARTS[0], &objects).unwrap(),
            "YWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWE=\n"
        );
        type Edit = fn(&mut Vec<Value>);
        let cases: &[(&str, Edit)] = &[
            ("lost on uninstall", |o| {
                o[1]["metadata"]["annotations"] = json!({})
            }),
            ("another Secret mounted", |o| {
                o[1]["metadata"]["name"] = json!("other")
            }),
            ("no Secret", |o| {
                o.pop();
            }),
            ("a short key", |o| {
                o[1]["data"]["keys"] = json!("WVdGaFlRPT0K")
            }),
            ("no key", |o| o[1]["data"]["keys"] = json!("Cg==")),
            ("not base64", |o| o[1]["data"]["keys"] = json!("!!!!")),
            ("the key under another name", |o| {
                o[1]["data"] = json!({"other": o[1]["data"]["keys"].clone()})
            }),
            ("no key file flag", |o| {
                o[0]["spec"]["template"]["spec"]["containers"][0]["args"]
                    .as_array_mut()
                    .unwrap()
                    .pop();
            }),
        ];
        for (what, edit) in cases {
            let mut broken = objects.clone();
            edit(&mut broken);
            assert!(
                check_generated_key(&CHARTS[0], &broken).is_err(),
                "{what} was not caught"
            );
        }
    }
}

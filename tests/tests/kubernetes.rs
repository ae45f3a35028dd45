//! The Kubernetes manifests (`deploy/kubernetes`), checked without a cluster: the base
//! and the example overlay render with `kubectl kustomize`, every object they make
//! (and the mesh Secret `mesh-secret.sh` makes) matches the Kubernetes API schemas
//! (kubernetes-validate, strict, offline), every `--flag` and `MCPGW_*` variable they
//! give the gateway is one `mcpgw serve --help` lists, and the wiring the docs promise
//! holds: probes on the admin port, the mesh port open to gateway pods only, a drain
//! that fits the grace period.
//!
//! Without kubectl the tests fail, saying what to install: a check that passes without
//! checking would hide a broken overlay. `MCPGW_ALLOW_SKIP=kubectl` lets them skip the
//! rendering instead (the base's files are checked as written, the overlay not), with
//! the reason printed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The oldest Kubernetes the manifests support (the preStop `sleep` action is on by
/// default from 1.30) and the newest the pinned kubernetes-validate knows.
const KUBERNETES_VERSIONS: [&str; 2] = ["1.30", "1.37"];

/// The worst case of a SIGTERM drain after its lame-duck delay, in seconds, as the
/// binary says it (`--drain-delay-ms`'s help: `DRAIN_WORST_CASE` in
/// gateway/src/process.rs): the public port's exchanges, the handover, forwarded
/// requests in flight, ending the sessions, "not mine" answers and the mesh's close.
fn drain_worst_case_secs() -> f64 {
    let out = Command::new(mcpgw_testkit::bin("mcpgw"))
        .args(["serve", "--help"])
        .output()
        .expect("run mcpgw serve --help");
    let help = String::from_utf8_lossy(&out.stdout);
    // "... a drain takes at most 41.5 s (drain worst case) ...", wrapped anywhere.
    let words: Vec<&str> = help.split_whitespace().collect();
    words
        .windows(4)
        .find(|w| w[0] == "most" && w[2] == "s" && w[3] == "(drain")
        .and_then(|w| w[1].parse().ok())
        .unwrap_or_else(|| panic!("mcpgw serve --help states the drain's worst case:\n{help}"))
}

fn deploy_dir() -> PathBuf {
    mcpgw_testkit::workspace_root().join("deploy/kubernetes")
}

/// Ok when kubectl runs; else the reason, if the environment allows skipping what
/// needs it (`MCPGW_ALLOW_SKIP` names `kubectl`); else the test fails here.
fn kubectl_available() -> Result<(), String> {
    let reason = match Command::new("kubectl")
        .args(["version", "--client"])
        .output()
    {
        Ok(out) if out.status.success() => return Ok(()),
        Ok(out) => format!(
            "`kubectl version --client` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => format!("kubectl cannot run: {e}"),
    };
    assert!(
        mcpgw_testkit::skip_allowed("kubectl"),
        "{reason}: install kubectl 1.27 or later (kustomize 5; Debian's kubernetes-client \
         is older), https://kubernetes.io/docs/tasks/tools/, or set MCPGW_ALLOW_SKIP=kubectl \
         to check the base's files unrendered"
    );
    Err(reason)
}

/// `kubectl kustomize DIR` into a file of `tmp`.
#[track_caller]
fn render(dir: &Path, tmp: &Path, name: &str) -> PathBuf {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run kubectl kustomize {}: {e}", dir.display()));
    assert!(
        out.status.success(),
        "kubectl kustomize {} failed: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let path = tmp.join(format!("{name}.yaml"));
    std::fs::write(&path, &out.stdout).expect("write the rendered manifests");
    path
}

/// The objects of the YAML files, each already checked against the API schemas; fails
/// with every object's schema errors.
#[track_caller]
fn validated_objects(files: &[PathBuf]) -> Vec<Value> {
    let mut args: Vec<String> = Vec::new();
    for version in KUBERNETES_VERSIONS {
        args.push("--kubernetes-version".into());
        args.push(version.into());
    }
    args.extend(files.iter().map(|f| f.display().to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let report = mcpgw_testkit::run_python("k8s_validate.py", &args);
    let entries = report["objects"].as_array().expect("objects").clone();
    let invalid: Vec<String> = entries
        .iter()
        .filter(|e| e["errors"].as_array().is_some_and(|a| !a.is_empty()))
        .map(|e| format!("{}: {}", kind_name(&e["object"]), e["errors"]))
        .collect();
    assert!(
        invalid.is_empty(),
        "objects that do not match the Kubernetes API schemas:\n{}",
        invalid.join("\n")
    );
    entries.into_iter().map(|e| e["object"].clone()).collect()
}

/// The schema check can fail: a Deployment whose `replicas` is a string is refused,
/// the error named, under every Kubernetes version checked.
#[test]
fn the_schema_check_refuses_an_invalid_object() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let file = tmp.path().join("invalid.yaml");
    std::fs::write(
        &file,
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: broken\nspec:\n  \
         replicas: \"three\"\n  selector:\n    matchLabels: {app: broken}\n  template:\n    \
         metadata:\n      labels: {app: broken}\n    spec:\n      containers:\n      - image: mcpgw\n",
    )
    .expect("write the invalid object");
    let mut args: Vec<String> = Vec::new();
    for version in KUBERNETES_VERSIONS {
        args.push("--kubernetes-version".into());
        args.push(version.into());
    }
    args.push(file.display().to_string());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let report = mcpgw_testkit::run_python("k8s_validate.py", &args);
    let entries = report["objects"].as_array().expect("objects");
    assert_eq!(entries.len(), 1, "{report}");
    let errors = entries[0]["errors"].as_array().expect("errors");
    for version in KUBERNETES_VERSIONS {
        assert!(
            errors.iter().any(|e| e
                .as_str()
                .is_some_and(|e| e.starts_with(&format!("{version}: spec.replicas")))),
            "Kubernetes {version} refuses the string replicas: {errors:?}"
        );
    }
}

fn kind_name(object: &Value) -> String {
    format!(
        "{}/{}",
        object["kind"].as_str().unwrap_or("?"),
        object["metadata"]["name"].as_str().unwrap_or("?")
    )
}

/// The base and the example overlay, rendered, as (label, objects). Without kubectl,
/// the base's resource files as written.
fn manifests(tmp: &Path) -> Vec<(&'static str, Vec<Value>)> {
    match kubectl_available() {
        Ok(()) => {
            let base = render(&deploy_dir().join("base"), tmp, "base");
            let overlay = render(&deploy_dir().join("overlays/example"), tmp, "example");
            vec![
                ("base", validated_objects(&[base])),
                ("overlays/example", validated_objects(&[overlay])),
            ]
        }
        Err(reason) => {
            println!(
                "SKIPPED rendering with kubectl kustomize ({reason}); checking the base's files as written, not the overlay"
            );
            let mut files: Vec<PathBuf> = std::fs::read_dir(deploy_dir().join("base"))
                .expect("read deploy/kubernetes/base")
                .map(|e| e.expect("dir entry").path())
                .filter(|p| {
                    p.extension().is_some_and(|x| x == "yaml")
                        && p.file_name().is_some_and(|n| n != "kustomization.yaml")
                })
                .collect();
            files.sort();
            vec![("base (unrendered)", validated_objects(&files))]
        }
    }
}

fn the<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind}/{name} among the manifests"))
}

/// The flags and the `MCPGW_*` variables `mcpgw serve` accepts, from its `--help`.
fn serve_help() -> (BTreeSet<String>, BTreeSet<String>) {
    let out = Command::new(mcpgw_testkit::bin("mcpgw"))
        .args(["serve", "--help"])
        .output()
        .expect("run mcpgw serve --help");
    assert!(out.status.success(), "mcpgw serve --help failed");
    let help = String::from_utf8_lossy(&out.stdout);
    let mut flags = BTreeSet::new();
    let mut vars = BTreeSet::new();
    for line in help.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with('-') {
            for word in trimmed.split([' ', ',']) {
                if word.starts_with("--") {
                    flags.insert(word.to_owned());
                }
            }
        }
        if let Some(at) = trimmed.find("[env: ") {
            let name: String = trimmed[at + 6..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            vars.insert(name);
        }
    }
    // The parse itself must have worked, or every comparison below passes vacuously.
    assert!(
        flags.contains("--mesh-advertise") && vars.contains("MCPGW_REDIS_URL"),
        "could not read flags and variables from mcpgw serve --help:\n{help}"
    );
    (flags, vars)
}

/// Every container of every pod template among `objects`, with the object's name.
fn containers(objects: &[Value]) -> Vec<(String, &Value)> {
    let mut found = Vec::new();
    for object in objects {
        if let Some(list) = object["spec"]["template"]["spec"]["containers"].as_array() {
            found.extend(list.iter().map(|c| (kind_name(object), c)));
        }
    }
    found
}

fn env_names(container: &Value) -> Vec<String> {
    container["env"]
        .as_array()
        .map(|env| {
            env.iter()
                .filter_map(|e| e["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The `$(NAME)` references in `text` (Kubernetes expands them from the container's
/// env, and leaves an undefined one in place as literal text).
fn references(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("$(") {
        rest = &rest[at + 2..];
        let Some(end) = rest.find(')') else { break };
        names.push(rest[..end].to_owned());
        rest = &rest[end..];
    }
    names
}

#[test]
fn base_and_example_overlay_render_and_every_object_matches_the_kubernetes_api_schemas() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let sets = manifests(tmp.path());
    for (label, objects) in &sets {
        let kinds: BTreeSet<String> = objects
            .iter()
            .map(|o| o["kind"].as_str().unwrap_or("?").to_owned())
            .collect();
        println!("{label}: {} objects valid: {kinds:?}", objects.len());
        for kind in [
            "StatefulSet",
            "Service",
            "PodDisruptionBudget",
            "NetworkPolicy",
        ] {
            assert!(kinds.contains(kind), "{label} makes no {kind}: {kinds:?}");
        }
    }
}

#[test]
fn every_flag_and_mcpgw_variable_the_manifests_give_the_gateway_is_one_mcpgw_serve_accepts() {
    let (flags, vars) = serve_help();
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut unknown = Vec::new();
    let mut checked = 0;
    for (label, objects) in manifests(tmp.path()) {
        for (object, container) in containers(&objects) {
            let args: Vec<&str> = container["args"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            assert_eq!(
                args.first().copied(),
                Some("serve"),
                "{label} {object}: the gateway's args must start with the serve command"
            );
            for arg in &args[1..] {
                if arg.starts_with("--") {
                    let flag = arg.split('=').next().unwrap_or(arg);
                    checked += 1;
                    if !flags.contains(flag) {
                        unknown.push(format!("{label} {object}: flag {flag}"));
                    }
                }
            }
            let mut names = env_names(container);
            // And the keys of whatever the container takes whole (envFrom).
            for source in container["envFrom"].as_array().into_iter().flatten() {
                let prefix = source["prefix"].as_str().unwrap_or("");
                let map = if let Some(name) = source["configMapRef"]["name"].as_str() {
                    Some(the(&objects, "ConfigMap", name))
                } else if let Some(name) = source["secretRef"]["name"].as_str() {
                    objects
                        .iter()
                        .find(|o| o["kind"] == "Secret" && o["metadata"]["name"] == name)
                } else {
                    None
                };
                if let Some(data) = map.and_then(|m| m["data"].as_object()) {
                    names.extend(data.keys().map(|k| format!("{prefix}{k}")));
                }
            }
            for name in names.iter().filter(|n| n.starts_with("MCPGW_")) {
                checked += 1;
                if !vars.contains(name) {
                    unknown.push(format!("{label} {object}: variable {name}"));
                }
            }
            // A misspelt $(POD_IP) would reach the gateway as literal text.
            let defined = env_names(container);
            let values = container["env"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|e| e["value"].as_str());
            for text in args.iter().copied().chain(values) {
                for name in references(text) {
                    if !defined.contains(&name) {
                        unknown.push(format!(
                            "{label} {object}: $({name}) in {text:?} names no variable of the container"
                        ));
                    }
                }
            }
        }
    }
    println!("checked {checked} flags and variables against mcpgw serve --help");
    assert!(
        unknown.is_empty(),
        "the manifests use what mcpgw serve does not accept:\n{}",
        unknown.join("\n")
    );
}

/// A container port's number, by name or number.
fn port_number(container: &Value, port: &Value) -> Option<i64> {
    port.as_i64().or_else(|| {
        container["ports"]
            .as_array()?
            .iter()
            .find(|p| p["name"] == *port)?["containerPort"]
            .as_i64()
    })
}

fn flag_value<'a>(container: &'a Value, flag: &str) -> Option<&'a str> {
    container["args"]
        .as_array()?
        .iter()
        .filter_map(Value::as_str)
        .find_map(|a| a.strip_prefix(flag)?.strip_prefix('='))
}

#[test]
fn probes_mesh_port_policy_drain_grace_and_certificates_are_wired_as_documented() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for (label, objects) in manifests(tmp.path()) {
        let set = the(&objects, "StatefulSet", "mcpgw");
        let pod = &set["spec"]["template"];
        let container = &pod["spec"]["containers"][0];
        let pod_labels = &pod["metadata"]["labels"];

        // Probes reach the admin listener, which must listen beyond loopback for them.
        let admin = flag_value(container, "--admin-listen").unwrap_or("");
        let admin_port: i64 = admin
            .strip_prefix("0.0.0.0:")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("{label}: --admin-listen {admin:?} is not 0.0.0.0:PORT"));
        for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
            let get = &container[probe]["httpGet"];
            assert_eq!(get["path"], path, "{label}: {probe} path");
            assert_eq!(
                port_number(container, &get["port"]),
                Some(admin_port),
                "{label}: {probe} must probe the admin port"
            );
        }
        assert_eq!(
            pod["metadata"]["annotations"]["prometheus.io/port"],
            admin_port.to_string(),
            "{label}: Prometheus must scrape the admin port"
        );

        // The mesh: a fixed port, advertised as the pod IP from the downward API.
        let mesh_port: i64 = flag_value(container, "--mesh-listen")
            .and_then(|l| l.strip_prefix("0.0.0.0:"))
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("{label}: --mesh-listen is not 0.0.0.0:PORT"));
        assert_ne!(mesh_port, 0, "{label}: the mesh port must be fixed");
        assert_eq!(
            flag_value(container, "--mesh-advertise"),
            Some(format!("$(POD_IP):{mesh_port}").as_str()),
            "{label}: --mesh-advertise"
        );
        let pod_ip = container["env"]
            .as_array()
            .and_then(|env| env.iter().find(|e| e["name"] == "POD_IP"));
        assert_eq!(
            pod_ip.map(|e| &e["valueFrom"]["fieldRef"]["fieldPath"]),
            Some(&Value::from("status.podIP")),
            "{label}: POD_IP must come from the downward API"
        );

        // Only gateway pods reach the mesh port: every rule that opens it admits
        // exactly the StatefulSet's pods, and no rule opens every port.
        let policy = the(&objects, "NetworkPolicy", "mcpgw");
        assert_eq!(
            policy["spec"]["podSelector"]["matchLabels"], set["spec"]["selector"]["matchLabels"],
            "{label}: the NetworkPolicy must cover the gateway pods"
        );
        let mut mesh_rules = 0;
        for rule in policy["spec"]["ingress"].as_array().expect("ingress rules") {
            let ports = rule["ports"].as_array();
            let opens_mesh = ports.is_none_or(|ports| {
                ports
                    .iter()
                    .any(|p| port_number(container, &p["port"]) == Some(mesh_port))
            });
            if !opens_mesh {
                continue;
            }
            mesh_rules += 1;
            let from = rule["from"].as_array().map(Vec::as_slice).unwrap_or(&[]);
            assert!(
                !from.is_empty()
                    && from.iter().all(|peer| {
                        peer.get("namespaceSelector").is_none()
                            && peer.get("ipBlock").is_none()
                            && peer["podSelector"]["matchLabels"]
                                .as_object()
                                .is_some_and(|want| {
                                    !want.is_empty()
                                        && want.iter().all(|(k, v)| pod_labels[k] == *v)
                                })
                    }),
                "{label}: a NetworkPolicy rule opens the mesh port to more than gateway pods: {rule}"
            );
        }
        assert!(
            mesh_rules > 0,
            "{label}: no rule lets gateway pods reach the mesh port"
        );

        // SIGTERM drain: the preStop pause plus the drain's worst case fit the grace.
        let drain_worst_case = drain_worst_case_secs();
        let grace = pod["spec"]["terminationGracePeriodSeconds"]
            .as_f64()
            .unwrap_or(30.0);
        let pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
            .as_f64()
            .unwrap_or(0.0);
        let delay = flag_value(container, "--drain-delay-ms")
            .map(|ms| ms.parse::<f64>().expect("--drain-delay-ms is a number") / 1000.0)
            .unwrap_or(0.0);
        println!(
            "{label}: grace {grace} s for {pause} s preStop + {delay} s lame duck + {drain_worst_case} s drain"
        );
        assert!(
            grace > pause + delay + drain_worst_case,
            "{label}: terminationGracePeriodSeconds {grace} does not cover {pause} s preStop + {delay} s lame duck + {drain_worst_case} s drain"
        );

        // Certificates: a Secret volume mounted whole (a subPath mount never sees the
        // kubelet's updates, so rotation would need restarts), holding the flags' files.
        let cert = flag_value(container, "--mesh-cert").unwrap_or("");
        let cert_dir = Path::new(cert)
            .parent()
            .expect("--mesh-cert has a directory");
        let mount = container["volumeMounts"]
            .as_array()
            .and_then(|m| {
                m.iter()
                    .find(|m| Path::new(m["mountPath"].as_str().unwrap_or("")) == cert_dir)
            })
            .unwrap_or_else(|| panic!("{label}: nothing is mounted at {}", cert_dir.display()));
        assert!(
            mount.get("subPath").is_none(),
            "{label}: the mesh Secret is mounted with subPath"
        );
        let volume = pod["spec"]["volumes"]
            .as_array()
            .and_then(|v| v.iter().find(|v| v["name"] == mount["name"]))
            .expect("the mesh volume");
        assert_eq!(
            volume["secret"]["secretName"], "mcpgw-mesh",
            "{label}: mesh volume"
        );
        assert_eq!(
            cert, "/etc/mcpgw/mesh/$(POD_NAME).crt",
            "{label}: one leaf per pod"
        );
    }
}

#[test]
fn mesh_secret_script_publishes_the_bundle_and_each_pods_leaf_and_never_a_ca_key() {
    if let Err(reason) = kubectl_available() {
        println!("SKIPPED: mesh-secret.sh runs kubectl ({reason})");
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("certs");
    let dir_arg = dir.display().to_string();
    let mcpgw = |args: &[&str]| {
        let out = Command::new(mcpgw_testkit::bin("mcpgw"))
            .args(args)
            .output()
            .expect("run mcpgw certs");
        assert!(
            out.status.success(),
            "mcpgw {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    mcpgw(&["certs", "init", "--dir", &dir_arg]);
    for name in ["mcpgw-0", "mcpgw-1"] {
        mcpgw(&["certs", "issue", "--dir", &dir_arg, "--name", name]);
    }
    // Mid-rotation the directory also holds the next CA's key: it must stay behind too.
    mcpgw(&["certs", "rotate", "begin", "--dir", &dir_arg]);
    let script = deploy_dir().join("mesh-secret.sh");
    // Without the adoption key the script refuses and says how to make one.
    let out = Command::new(&script)
        .args([&dir_arg, "2"])
        .output()
        .expect("run mesh-secret.sh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "no adoption key: {stderr}");
    assert!(out.stdout.is_empty(), "a refused run must print no Secret");
    assert!(stderr.contains("adoption.key"), "{stderr}");
    std::fs::write(dir.join("adoption.key"), format!("{}\n", "ab".repeat(32)))
        .expect("write the adoption key");
    let out = Command::new(&script)
        .args([&dir_arg, "2"])
        .output()
        .expect("run mesh-secret.sh");
    assert!(
        out.status.success(),
        "mesh-secret.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let secret_file = tmp.path().join("secret.yaml");
    std::fs::write(&secret_file, &out.stdout).expect("write the Secret");
    let objects = validated_objects(&[secret_file]);
    let secret = the(&objects, "Secret", "mcpgw-mesh");
    let keys: BTreeSet<&str> = secret["data"]
        .as_object()
        .expect("Secret data")
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        BTreeSet::from([
            "adoption.key",
            "ca.crt",
            "mcpgw-0.crt",
            "mcpgw-0.key",
            "mcpgw-1.crt",
            "mcpgw-1.key"
        ]),
        "the mesh Secret must hold the bundle, the pods' leaves and the adoption key, nothing else"
    );

    // A pod without a leaf is refused before anything reaches the cluster.
    let out = Command::new(&script)
        .args([&dir_arg, "3"])
        .output()
        .expect("run mesh-secret.sh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "mesh-secret.sh for 3 pods, 2 leaves: {stderr}"
    );
    assert!(out.stdout.is_empty(), "a refused run must print no Secret");
    assert!(
        stderr.contains("mcpgw certs issue --dir") && stderr.contains("--name mcpgw-2"),
        "the refusal must say which leaf to issue: {stderr}"
    );
}

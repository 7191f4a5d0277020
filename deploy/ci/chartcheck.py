"""Render, lint and validate the provider Helm charts; driven by `cargo xtask helm`.

Rendering and linting use Helm's own Go engine (the helm-python-sdk wheel binds to it), so
templates behave exactly as under `helm template` / `helm lint`. Kubernetes objects are
validated strictly (unknown fields rejected) against the schemas that kubernetes-validate
ships; ServiceMonitor, a prometheus-operator CRD, against schemas/servicemonitor.json.

Commands:
  check CHART [--values FILE] --release NAME --namespace NS --json OUT
      lint (strict), render, validate; print the render as `helm template` would and write
      the objects as a JSON list to OUT.
  render CHART [--values FILE] --release NAME --namespace NS
      render only (used for the cases that must fail); exit 1 with Helm's message.
  values-table CHART
      print the chart README's values table, generated from the "# --" comments in
      values.yaml.
  validate FILE...
      validate every object of plain manifests (the Secret examples) the same way.
"""

import argparse
import json
import os
import sys

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
# The oldest Kubernetes the charts support (Chart.yaml kubeVersion) and the newest schema set.
KUBE_VERSIONS = ("1.25.0", "1.37.0")
# Kinds newer than the oldest supported Kubernetes: validated only against the schema sets that
# have them (the charts render them only where the cluster serves them).
MIN_KUBE_VERSION = {
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"): (1, 30),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"): (1, 30),
}
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): os.path.join(HERE, "schemas", "servicemonitor.json"),
    ("monitoring.coreos.com/v1", "PrometheusRule"): os.path.join(HERE, "schemas", "prometheusrule.json"),
}


def load_values(path):
    if not path:
        return None
    with open(path, encoding="utf-8") as handle:
        return yaml.safe_load(handle) or {}


def render(chart_dir, values_path, release, namespace):
    """Returns [(template path, manifest text)] in template order, NOTES and blanks left out."""
    values = load_values(values_path)
    with helm.Chart.load(chart_dir) as chart:
        chart.validate_schema(values)
        manifests = chart.render(values, name=release, namespace=namespace, is_install=True)
    return [
        (path, text.strip("\n"))
        for path, text in sorted(manifests.items())
        if not path.endswith("NOTES.txt") and text.strip()
    ]


def lint(chart_dir, values_path):
    report = helm.lint(chart_dir, load_values(values_path), strict=True)
    # Severity 2 is a warning, 3 an error; strict mode fails on both, as `helm lint --strict`.
    problems = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2]
    problems += [{"path": chart_dir, "error": e} for e in report.get("errors", [])]
    if problems:
        raise SystemExit(
            "helm lint --strict failed:\n"
            + "\n".join(f"  {p.get('path')}: {p.get('error')}" for p in problems)
        )


def validate(obj, where):
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in CRD_SCHEMAS:
        with open(CRD_SCHEMAS[key], encoding="utf-8") as handle:
            schema = json.load(handle)
        try:
            jsonschema.Draft202012Validator(schema).validate(obj)
        except jsonschema.ValidationError as error:
            raise SystemExit(f"{where}: {key[1]} is invalid at {list(error.absolute_path)}: {error.message}")
        return
    minimum = MIN_KUBE_VERSION.get(key, (0, 0))
    for version in KUBE_VERSIONS:
        if tuple(int(part) for part in version.split(".")[:2]) < minimum:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            raise SystemExit(
                f"{where}: {key[1]} is invalid for Kubernetes {version} at "
                f"{list(error.absolute_path)}: {error.message}"
            )
        except kubernetes_validate.SchemaNotFoundError as error:
            raise SystemExit(f"{where}: {error.message}")


def check(args):
    lint(args.chart, args.values)
    rendered = render(args.chart, args.values, args.release, args.namespace)
    objects = []
    stream = []
    for path, text in rendered:
        stream.append(f"---\n# Source: {path}\n{text}\n")
        for document in yaml.safe_load_all(text):
            if document is None:
                continue
            validate(document, path)
            objects.append(document)
    with open(args.json, "w", encoding="utf-8") as handle:
        json.dump(objects, handle, indent=1, sort_keys=True)
    sys.stdout.write("".join(stream))


def render_only(args):
    rendered = render(args.chart, args.values, args.release, args.namespace)
    for path, text in rendered:
        sys.stdout.write(f"---\n# Source: {path}\n{text}\n")


def validate_files(args):
    for path in args.files:
        with open(path, encoding="utf-8") as handle:
            documents = [d for d in yaml.safe_load_all(handle) if d is not None]
        if not documents:
            raise SystemExit(f"{path}: no objects")
        for document in documents:
            validate(document, path)


def documented_keys(values_path):
    """Yields (dotted key, description) for every key preceded by a "# --" comment."""
    stack = []  # (indent, key) of the open mappings
    pending = None
    with open(values_path, encoding="utf-8") as handle:
        for raw in handle:
            line = raw.rstrip("\n")
            stripped = line.strip()
            if stripped.startswith("# -- "):
                pending = stripped[len("# -- "):]
                continue
            if not stripped or stripped.startswith("#") or stripped.startswith("- "):
                if not stripped:
                    pending = None
                continue
            indent = len(line) - len(line.lstrip(" "))
            key = stripped.split(":", 1)[0].strip()
            while stack and stack[-1][0] >= indent:
                stack.pop()
            dotted = ".".join([k for _, k in stack] + [key])
            if pending is not None:
                yield dotted, pending
                pending = None
            stack.append((indent, key))


def lookup(values, dotted):
    node = values
    for part in dotted.split("."):
        node = node[part]
    return node


def values_table(args):
    values_path = os.path.join(args.chart, "values.yaml")
    values = load_values(values_path)
    rows = ["| Key | Default | Description |", "| --- | --- | --- |"]
    for dotted, description in documented_keys(values_path):
        default = json.dumps(lookup(values, dotted), separators=(", ", ": "))
        default = default.replace("|", "\\|")
        rows.append(f"| `{dotted}` | `{default}` | {description} |")
    sys.stdout.write("\n".join(rows) + "\n")


def admission_cases(args):
    """Evaluates the rendered leader-label ValidatingAdmissionPolicy (its matchConditions and
    validations, with a CEL interpreter) against patches of a release pod built from the rendered
    Deployment, and fails unless exactly the leader-label patches by the provider are admitted."""
    import copy

    import celpy

    with open(args.json, encoding="utf-8") as handle:
        objects = json.load(handle)
    policies = [o for o in objects if o.get("kind") == "ValidatingAdmissionPolicy"]
    deployments = [o for o in objects if o.get("kind") == "Deployment"]
    if len(policies) != 1 or len(deployments) != 1:
        raise SystemExit(f"expected one ValidatingAdmissionPolicy and one Deployment, found {len(policies)} and {len(deployments)}")
    policy, deployment = policies[0]["spec"], deployments[0]
    template = deployment["spec"]["template"]
    account = template["spec"]["serviceAccountName"]
    provider = f"system:serviceaccount:{args.namespace}:{account}"
    env = celpy.Environment()
    conditions = [env.program(env.compile(c["expression"])) for c in policy.get("matchConditions", [])]
    validations = [(v["expression"], env.program(env.compile(v["expression"]))) for v in policy["validations"]]

    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{deployment['metadata']['name']}-abc12",
            "namespace": args.namespace,
            "labels": dict(template["metadata"]["labels"], **{"bigfleet-leader": "false", "pod-template-hash": "5d9f8c7b6"}),
            "annotations": dict(template["metadata"].get("annotations") or {}),
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "1"}],
        },
        "spec": copy.deepcopy(template["spec"]),
    }

    def patched(change):
        new = copy.deepcopy(pod)
        change(new)
        return new

    def set_label(key, value):
        return lambda p: p["metadata"]["labels"].__setitem__(key, value)

    def drop_label(key):
        return lambda p: p["metadata"]["labels"].pop(key)

    def other_release(p):
        p["metadata"]["labels"]["app.kubernetes.io/instance"] = "someone-else"

    def image(p):
        p["spec"]["containers"][0]["image"] = "attacker/image:latest"

    def annotate(p):
        p["metadata"]["annotations"]["example.com/x"] = "y"

    def finalizer(p):
        p["metadata"]["finalizers"] = ["example.com/hold"]

    def disown(p):
        p["metadata"].pop("ownerReferences")

    # (what, user, old pod change, new pod change, admitted)
    cases = [
        ("the leader label set to true", provider, None, set_label("bigfleet-leader", "true"), True),
        ("the leader label set to false", provider, set_label("bigfleet-leader", "true"), set_label("bigfleet-leader", "false"), True),
        ("the leader label added", provider, drop_label("bigfleet-leader"), set_label("bigfleet-leader", "true"), True),
        ("the leader label set to another value", provider, None, set_label("bigfleet-leader", "yes"), False),
        ("another label changed", provider, None, set_label("app.kubernetes.io/name", "x"), False),
        ("another label added", provider, None, set_label("example.com/owner", "x"), False),
        ("another label removed", provider, None, drop_label("pod-template-hash"), False),
        ("the image changed", provider, None, image, False),
        ("an annotation added", provider, None, annotate, False),
        ("a finalizer added", provider, None, finalizer, False),
        ("the owner references removed", provider, None, disown, False),
        ("the leader label on another release's pod", provider, other_release, lambda p: (other_release(p), set_label("bigfleet-leader", "true")(p)), False),
        ("the leader label on a pod of another namespace", provider, lambda p: p["metadata"].__setitem__("namespace", "other"), lambda p: (p["metadata"].__setitem__("namespace", "other"), set_label("bigfleet-leader", "true")(p)), False),
        ("another user changing the image (not this policy's business)", "system:serviceaccount:kube-system:deployment-controller", None, image, True),
    ]
    def passes(result):
        # An evaluation error (a CELEvalError value) refuses, as the API server does.
        return isinstance(result, celpy.celtypes.BoolType) and bool(result)

    failures = []
    for what, user, old_change, new_change, want in cases:
        old = patched(old_change) if old_change else copy.deepcopy(pod)
        new = copy.deepcopy(old)
        new_change(new)
        activation = {
            "object": celpy.json_to_cel(new),
            "oldObject": celpy.json_to_cel(old),
            "request": celpy.json_to_cel({"userInfo": {"username": user}, "operation": "UPDATE"}),
        }
        matched = all(passes(c.evaluate(activation)) for c in conditions)
        refused = [expr for expr, program in validations if matched and not passes(program.evaluate(activation))]
        admitted = not refused
        verdict = "admitted" if admitted else "refused"
        print(f"{what}: {verdict}")
        if admitted != want:
            failures.append(f"{what}: {verdict}, expected {'admitted' if want else 'refused'}")
    if failures:
        raise SystemExit("leader-label admission policy:\n  " + "\n  ".join(failures))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("check", "render"):
        command = commands.add_parser(name)
        command.add_argument("chart")
        command.add_argument("--values")
        command.add_argument("--release", required=True)
        command.add_argument("--namespace", required=True)
        if name == "check":
            command.add_argument("--json", required=True)
    table = commands.add_parser("values-table")
    table.add_argument("chart")
    cases = commands.add_parser("admission-cases")
    cases.add_argument("--json", required=True)
    cases.add_argument("--namespace", required=True)
    files = commands.add_parser("validate")
    files.add_argument("files", nargs="+")
    args = parser.parse_args()
    handlers = {"check": check, "render": render_only, "values-table": values_table, "validate": validate_files, "admission-cases": admission_cases}
    try:
        handlers[args.command](args)
    except helm.HelmError as error:
        raise SystemExit(f"helm: {error}")


if __name__ == "__main__":
    main()

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
    for version in KUBE_VERSIONS:
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
    files = commands.add_parser("validate")
    files.add_argument("files", nargs="+")
    args = parser.parse_args()
    handlers = {"check": check, "render": render_only, "values-table": values_table, "validate": validate_files}
    try:
        handlers[args.command](args)
    except helm.HelmError as error:
        raise SystemExit(f"helm: {error}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Writes the excerpts of the official API documents that the emulators' spec tests read.

Usage: excerpt.py hetzner  <cloud.spec.json> <commit> <date>         > hetzner-cloud.excerpt.json
       excerpt.py digitalocean <specification/ dir> <commit> <date>  > digitalocean.excerpt.json

An excerpt keeps, for each operation the providers' clients call, its `operationId` and the
JSON schema of each response (by status, `4xx`-style ranges and `default` included), with only
the schema keywords the validator in `src/lib.rs` reads. `$ref`s to other files of a split
document are resolved: each referenced schema becomes one entry of `components.schemas`, and the
reference points there. Descriptions, examples, headers, parameters and request bodies are left
out. Needs PyYAML for the DigitalOcean document.
"""

import json
import os
import sys

# The operations the providers' clients call (crates/hetzner/src/api.rs,
# crates/digitalocean/src/api.rs), by path and method, in the documents' own spelling.
HETZNER = [
    ("/servers", "get"),
    ("/servers", "post"),
    ("/servers/{id}", "get"),
    ("/servers/{id}", "put"),
    ("/servers/{id}", "delete"),
    ("/servers/{id}/actions/attach_to_network", "post"),
    ("/server_types", "get"),
    ("/locations", "get"),
    ("/images", "get"),
    ("/images/{id}", "get"),
    ("/networks", "get"),
    ("/networks/{id}", "get"),
    ("/firewalls", "get"),
    ("/firewalls/{id}", "get"),
    ("/ssh_keys", "get"),
    ("/ssh_keys/{id}", "get"),
    ("/placement_groups", "get"),
    ("/placement_groups", "post"),
    ("/placement_groups/{id}", "delete"),
]

DIGITALOCEAN = [
    ("/v2/droplets", "get"),
    ("/v2/droplets", "post"),
    ("/v2/droplets/{droplet_id}", "get"),
    ("/v2/droplets/{droplet_id}", "delete"),
    ("/v2/actions", "get"),
    ("/v2/sizes", "get"),
    ("/v2/regions", "get"),
    ("/v2/account", "get"),
    ("/v2/account/keys", "get"),
    ("/v2/account/keys/{ssh_key_identifier}", "get"),
    ("/v2/images", "get"),
    ("/v2/images/{image_id}", "get"),
    ("/v2/vpcs/{vpc_id}", "get"),
    ("/v2/firewalls", "get"),
    ("/v2/tags", "post"),
    ("/v2/tags/{tag_id}/resources", "post"),
    ("/v2/tags/{tag_id}/resources", "delete"),
]

# The schema keywords kept (what the validator checks, plus `deprecated`).
SCHEMA_KEYS = {
    "type", "nullable", "required", "properties", "items", "enum", "format", "allOf",
    "oneOf", "anyOf", "additionalProperties", "$ref", "deprecated",
}


class Doc:
    """A document, possibly split over files, whose `$ref`s are resolved on reading."""

    def __init__(self, root_file):
        self.root = os.path.dirname(os.path.abspath(root_file))
        self.files = {}
        self.schemas = {}
        self.main = os.path.abspath(root_file)

    def load(self, path):
        if path not in self.files:
            with open(path) as f:
                if path.endswith(".json"):
                    self.files[path] = json.load(f)
                else:
                    import yaml

                    self.files[path] = yaml.safe_load(f)
        return self.files[path]

    def locate(self, ref, base):
        """The (file, pointer) `ref`, found in `base`, names."""
        target, _, pointer = ref.partition("#")
        path = base if not target else os.path.normpath(os.path.join(os.path.dirname(base), target))
        return path, pointer

    def at(self, path, pointer):
        node = self.load(path)
        for part in [p for p in pointer.split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node[int(part)] if isinstance(node, list) else node[part]
        return node

    def deref(self, node, base):
        """`node` with a `$ref` at its top followed (for operations and responses)."""
        while isinstance(node, dict) and "$ref" in node:
            base, pointer = self.locate(node["$ref"], base)
            node = self.at(base, pointer)
        return node, base

    def name(self, path, pointer):
        rel = os.path.relpath(path, self.root)
        for prefix in ("resources/",):
            rel = rel[len(prefix):] if rel.startswith(prefix) else rel
        rel = rel.rsplit(".", 1)[0].replace("/", ".")
        if pointer.strip("/"):
            rel += "." + pointer.strip("/").replace("/", ".")
        return rel

    def schema(self, node, base):
        """`node` with only the kept keywords; `$ref`s become `#/components/schemas/<name>`."""
        if isinstance(node, list):
            return [self.schema(n, base) for n in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            path, pointer = self.locate(node["$ref"], base)
            name = self.name(path, pointer)
            if name not in self.schemas:
                self.schemas[name] = None  # a cycle refers to it while it is being written
                self.schemas[name] = self.schema(self.at(path, pointer), path)
            return {"$ref": "#/components/schemas/" + name}
        out = {}
        for key, value in node.items():
            if key not in SCHEMA_KEYS:
                continue
            if key == "properties":
                out[key] = {k: self.schema(v, base) for k, v in value.items()}
            elif key in ("items", "additionalProperties", "allOf", "oneOf", "anyOf"):
                out[key] = self.schema(value, base)
            else:
                out[key] = value
        return out

    def excerpt(self, operations, paths_of):
        paths = {}
        for path, method in operations:
            op, base = self.deref(paths_of[path][method], self.main)
            responses = {}
            for status, response in op["responses"].items():
                response, rbase = self.deref(response, base)
                content = (response.get("content") or {}).get("application/json")
                entry = {}
                if content and "schema" in content:
                    entry["schema"] = self.schema(content["schema"], rbase)
                responses[str(status)] = entry
            paths.setdefault(path, {})[method] = {
                "operationId": op.get("operationId"),
                "responses": responses,
            }
        return paths


def main():
    which, source, commit, date = sys.argv[1:5]
    if which == "hetzner":
        doc = Doc(source)
        top = doc.load(doc.main)
        operations, repo, files = HETZNER, "triargos/effect-hcloud", ["spec/cloud.spec.json"]
    else:
        doc = Doc(os.path.join(source, "DigitalOcean-public.v2.yaml"))
        top = doc.load(doc.main)
        operations, repo, files = DIGITALOCEAN, "digitalocean/openapi", ["specification/"]
    paths = doc.excerpt(operations, top["paths"])
    out = {
        "openapi": top["openapi"],
        "info": {
            "title": top["info"]["title"] + " (excerpt)",
            "version": str(top["info"].get("version")),
            "x-source": {
                "repository": "https://github.com/" + repo,
                "commit": commit,
                "files": files,
                "date": date,
            },
        },
        "paths": paths,
        "components": {"schemas": dict(sorted(doc.schemas.items()))},
    }
    json.dump(out, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

"""Validates Kubernetes objects against the API schemas, offline.

Reads multi-document YAML files (as `kubectl kustomize` prints them) and checks each
object with kubernetes-validate (the schemas ship inside the package; strict: a field
the API does not have is an error) for every Kubernetes version given. Prints one JSON
line: {"objects": [{"object": ..., "errors": ["1.30: path: message", ...]}]}, so the
Rust test reads the objects themselves too (flags, variables, selectors).

    k8s_validate.py --kubernetes-version 1.30 [--kubernetes-version 1.37] FILE...
"""

import argparse
import json
import sys

import kubernetes_validate
import yaml


def errors_of(obj, version):
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(part) for part in e.path) or "(top)"
        return [f"{version}: {path}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"{version}: no schema: {e}"]
    return []


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kubernetes-version", action="append", required=True)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    out = []
    for name in args.files:
        with open(name, encoding="utf-8") as f:
            for obj in yaml.safe_load_all(f):
                if obj is None:
                    continue
                errors = []
                for version in args.kubernetes_version:
                    errors += errors_of(obj, version)
                out.append({"object": obj, "errors": errors})
    json.dump({"objects": out}, sys.stdout, default=str)
    print()


if __name__ == "__main__":
    main()

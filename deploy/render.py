"""Renders a kustomization without kubectl or kustomize, for offline validation.

    python deploy/render.py deploy/k8s > rendered.yaml
    python deploy/render.py deploy/k8s/tls > rendered-tls.yaml

Handles the subset deploy/k8s uses: `resources` (files, or folders holding a kustomization: a
base), `patches` (JSON 6902 patch files aimed at one kind and name), `namespace` and `images`,
applied in kustomize's order. Anything else is refused rather than ignored, so a rendering here
can never silently differ from `kubectl apply -k`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
PATCH_OPS = {"add", "remove", "replace", "test"}
# Kinds in deploy/k8s that are not namespaced; kustomize leaves their metadata.namespace unset.
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding"}


def load_kustomization(folder: Path) -> dict[str, Any]:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    if unsupported := set(kustomization) - SUPPORTED_KEYS:
        raise SystemExit(
            f"render.py handles {sorted(SUPPORTED_KEYS)}; {folder}/kustomization.yaml also has {sorted(unsupported)}"
        )
    return kustomization


def render(folder: Path) -> list[dict[str, Any]]:
    """The resources of the kustomization in `folder`, in order, transformed."""
    kustomization = load_kustomization(folder)
    documents: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = folder / entry
        if path.is_dir() and (path / "kustomization.yaml").is_file():
            documents.extend(render(path))
        elif path.is_file():
            documents.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
        else:
            raise SystemExit(f"render.py handles resource files and kustomization folders; {path} is neither")
    for patch in kustomization.get("patches", []):
        apply_patch(documents, folder, patch)
    namespace = kustomization.get("namespace")
    for doc in documents:
        if namespace and doc["kind"] not in CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = namespace
        for container in pod_containers(doc):
            container["image"] = retag(container["image"], kustomization.get("images", []))
    return documents


def apply_patch(documents: list[dict[str, Any]], folder: Path, patch: dict[str, Any]) -> None:
    """A JSON 6902 patch file applied to the one resource its target names."""
    if set(patch) != {"path", "target"} or set(patch["target"]) != {"kind", "name"}:
        raise SystemExit(f"render.py handles patches with `path` and a `target` of kind and name only; got {patch}")
    operations = yaml.safe_load((folder / patch["path"]).read_text())
    if not isinstance(operations, list):
        raise SystemExit(
            f"render.py handles JSON 6902 patches (a list of operations) only; {folder / patch['path']} is not one"
        )
    target = patch["target"]
    matches = [doc for doc in documents if doc["kind"] == target["kind"] and doc["metadata"]["name"] == target["name"]]
    if len(matches) != 1:
        raise SystemExit(f"{folder / patch['path']}: target {target} matches {len(matches)} resources, not one")
    for operation in operations:
        apply_operation(matches[0], operation, folder / patch["path"])


def apply_operation(doc: dict[str, Any], operation: dict[str, Any], source: Path) -> None:
    """One RFC 6902 operation (add, remove, replace, test) on `doc`, in place."""
    op = operation.get("op")
    if op not in PATCH_OPS:
        raise SystemExit(f"{source}: render.py handles operations {sorted(PATCH_OPS)}; got {operation}")
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    fail = f"{source}: {operation['path']} does not exist"
    if isinstance(node, list):
        index = len(node) if last == "-" and op == "add" else int(last)
        if not 0 <= index <= len(node) - (op != "add"):
            raise SystemExit(fail)
    elif op != "add" and last not in node:
        raise SystemExit(fail)
    else:
        index = last
    if op == "test":
        if node[index] != operation["value"]:
            raise SystemExit(
                f"{source}: test failed: {operation['path']} is {node[index]!r}, not {operation['value']!r}"
            )
    elif op == "remove":
        del node[index]
    elif op == "replace":
        node[index] = operation["value"]
    elif isinstance(node, list):
        node.insert(index, operation["value"])
    else:
        node[index] = operation["value"]


def pod_containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def retag(image: str, rules: list[dict[str, str]]) -> str:
    """kustomize's `images` transform: match on the name without tag or digest."""
    name, tag = split_image(image)
    for rule in rules:
        if rule["name"] == name:
            new_name = rule.get("newName", name)
            if "digest" in rule:
                return f"{new_name}@{rule['digest']}"
            new_tag = f":{rule['newTag']}" if "newTag" in rule else tag
            return f"{new_name}{new_tag}"
    return image


def split_image(image: str) -> tuple[str, str]:
    """("registry:5000/repo", ":tag") or ("repo", "@sha256:...") or ("repo", "")."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, f"@{digest}"
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="folder holding kustomization.yaml")
    parser.add_argument(
        "--skip-kind",
        action="append",
        default=[],
        metavar="KIND",
        help="leave out resources of KIND: a custom resource kubernetes-validate has no schema for "
        "(tests/unit/test_deploy_files.py checks those)",
    )
    args = parser.parse_args(argv)
    documents = [doc for doc in render(args.folder) if doc["kind"] not in args.skip_kind]
    yaml.safe_dump_all(documents, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

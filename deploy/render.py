"""Renders a kustomization without kubectl or kustomize, for offline validation.

    python deploy/render.py deploy/k8s > rendered.yaml

Handles the subset deploy/k8s uses: `resources` (files), `namespace` and `images`, applied as
kustomize applies them. Any other key is refused rather than ignored, so a rendering here can
never silently differ from `kubectl apply -k`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "namespace", "resources", "images"}
# Kinds in deploy/k8s that are not namespaced; kustomize leaves their metadata.namespace unset.
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding"}


def load_kustomization(folder: Path) -> dict[str, Any]:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    if unsupported := set(kustomization) - SUPPORTED_KEYS:
        raise SystemExit(f"render.py handles {sorted(SUPPORTED_KEYS)}; {folder}/kustomization.yaml also has {sorted(unsupported)}")
    return kustomization


def render(folder: Path) -> list[dict[str, Any]]:
    """The resources of the kustomization in `folder`, in order, transformed."""
    kustomization = load_kustomization(folder)
    documents: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = folder / entry
        if not path.is_file():
            raise SystemExit(f"render.py handles resource files only; {path} is not one")
        documents.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    namespace = kustomization.get("namespace")
    for doc in documents:
        if namespace and doc["kind"] not in CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = namespace
        for container in pod_containers(doc):
            container["image"] = retag(container["image"], kustomization.get("images", []))
    return documents


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
    args = parser.parse_args(argv)
    yaml.safe_dump_all(render(args.folder), sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the operator's settings let a pool's creator ask for on the nodes (pure: reads nothing).

Whoever may create a ``KVCachePool`` chooses the image its sidecars run (``spec.image``),
and the operator's DaemonSet puts that image on every node the pool selects. What the
pod may get besides is the operator's to bound, since the pool's creator need not be
allowed to create pods at all (:class:`settings.PoolPolicySettings`):

- ``spec.priorityClassName``: a class such as ``system-node-critical`` preempts the
  nodes' other pods and is evicted last;
- ``spec.tolerations``: a toleration without a key tolerates every taint (the control
  plane's included), one with a key the taint of that key;
- ``spec.tiers.gpu.runtimeClassName``: which container runtime (handler) runs the pod;
- the GPU tier itself: ``NVIDIA_VISIBLE_DEVICES=all`` shows every GPU of the node, and the
  engines' memory on them, to the sidecar's image.

A spec that asks for more is refused like any invalid one (``InvalidSpec``, nothing
written: the pool's last good children stay).
"""

from __future__ import annotations

from kvpool_operator.settings import RESERVED_PRIORITY_PREFIX, PoolPolicySettings, name_allowed
from kvpool_operator.spec import PoolSpec


def _shown(allowed: tuple[str, ...]) -> str:
    return ", ".join(allowed) if allowed else "none"


def policy_problems(spec: PoolSpec, policy: PoolPolicySettings, sidecar_image: str) -> list[str]:
    """A message for each thing the spec asks for that ``policy`` does not allow.

    ``sidecar_image``: the operator's own sidecar image (``KVPOOL_OPERATOR_IMAGE``), which
    may always run a GPU tier.
    """
    problems: list[str] = []
    priority = spec.priority_class_name
    if priority and not name_allowed(priority, policy.priority_classes, reserved_prefix=RESERVED_PRIORITY_PREFIX):
        problems.append(
            "spec.priorityClassName: {!r} is not allowed for pools (the operator's KVPOOL_OPERATOR_PRIORITY_CLASSES: "
            "{}; a pattern never matches a class named {}*)".format(
                priority, _shown(policy.priority_classes), RESERVED_PRIORITY_PREFIX))
    for i, toleration in enumerate(spec.tolerations):
        key = str(toleration.get("key") or "")
        where = "spec.tolerations[{}]".format(i)
        if not key and "*" not in policy.toleration_keys:
            problems.append(
                "{}: a toleration without a key tolerates every taint, the control plane's included; not allowed "
                "for pools (the operator's KVPOOL_OPERATOR_TOLERATION_KEYS: {}; only '*' allows it)".format(
                    where, _shown(policy.toleration_keys)))
        elif key and not name_allowed(key, policy.toleration_keys):
            problems.append("{}: tolerating the taint key {!r} is not allowed for pools (the operator's "
                            "KVPOOL_OPERATOR_TOLERATION_KEYS: {})".format(where, key, _shown(policy.toleration_keys)))
    if spec.gpu is not None:
        runtime = spec.gpu.runtime_class
        if runtime and not name_allowed(runtime, policy.runtime_classes):
            problems.append("spec.tiers.gpu.runtimeClassName: {!r} is not allowed for pools (the operator's "
                            "KVPOOL_OPERATOR_RUNTIME_CLASSES: {})".format(runtime, _shown(policy.runtime_classes)))
        image = spec.image or sidecar_image
        if image != sidecar_image and not name_allowed(image, policy.gpu_images):
            problems.append(
                "spec.tiers.gpu: the GPU tier shows every GPU of the node to the sidecar (NVIDIA_VISIBLE_DEVICES=all); "
                "the operator allows it for its own sidecar image ({}) and the images in KVPOOL_OPERATOR_GPU_IMAGES "
                "({}) only, not spec.image {!r}".format(sidecar_image, _shown(policy.gpu_images), image))
    return problems

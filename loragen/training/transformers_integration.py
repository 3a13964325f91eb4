"""loragen in transformers: a loragen model's adapter methods, and its adapter in every Trainer checkpoint.

Once a transformers model holds loragen LoRA layers, its class is switched to a subclass of the same
name whose ``PeftAdapterMixin`` methods (``load_adapter``, ``add_adapter``, ``set_adapter``,
``disable_adapters`` / ``enable_adapters``, ``active_adapters``, ``get_adapter_state_dict``,
``delete_adapter``, ``save_pretrained``) and attributes (``peft_config``, ``_hf_peft_config_loaded``) call
loragen's functions with peft's semantics instead of driving peft; what cannot match raises an
:class:`~loragen.errors.AdapterError` naming the loragen call to use. A subclass, not per-instance methods, so that deepcopy and pickling work and ``isinstance`` and
``type(model).__name__`` are unchanged.

``LoraTrainerCallback`` makes every Trainer checkpoint hold the peft adapter and, for resuming, a
``model.safetensors`` with only what trains (the whole model with ``full_model=True``); Trainer's
"missing keys" warning is dropped when every missing key is a frozen tensor.
"""

from __future__ import annotations

import ast
import functools
import json
import logging
import os
import sys
import warnings
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Literal, cast

from torch import nn

from loragen.config import LoraConfig
from loragen.convert import add_conversion_hook, find_lora_layers
from loragen.errors import AdapterError, AdapterNameError, LoraError, TrainingSetupError

# LoraTrainerCallback itself is made on first access (module __getattr__ at the end)
__all__ = ["install_adapter_methods", "LoragenAdapterMethods", "make_trainer_callback_class"]


# disable_adapters() holds loragen's disable_adapter context open until enable_adapters()
_DISABLED: weakref.WeakKeyDictionary[nn.Module, AbstractContextManager[Any]] = weakref.WeakKeyDictionary()


# transformers' download keywords: meaningless for a local folder, which transformers reads without them
_HUB_KEYWORDS = frozenset(
    {"revision", "token", "cache_dir", "local_files_only", "force_download", "proxies", "user_agent"}
)


def _refuse(where: str, what: str, instead: str) -> LoraError:
    return AdapterError(f"{where}: {what} is not supported on a loragen model; {instead}")


# transformers' message for an adapter method called on a model without adapters
NO_ADAPTER = "No adapter loaded. Please load an adapter first."


def _require_adapters(model: nn.Module, where: str) -> list[str]:
    """The names of ``model``'s adapters, or transformers' error when it has none."""
    from loragen.adapters.named import list_adapters

    names = list_adapters(model)
    if not names:
        raise AdapterError(f"{where}: {NO_ADAPTER}")
    return names


class LoragenAdapterMethods:
    """The adapter methods of a loragen model's transformers class (see the module docstring)."""

    _loragen_base: type

    @property
    def peft_config(self) -> dict[str, LoraConfig]:
        """Each adapter's config by name, in the model's order (transformers' ``peft_config``): the
        ``LoraConfig`` that ``save_pretrained`` writes for it, with peft's field names. No attribute when
        the model holds no adapter (after the last ``delete_adapter``), as in transformers.

        Raises:
            AttributeError: the model holds no adapter.
        """
        from loragen.adapters.named import list_adapters
        from loragen.adapters.save import adapter_config_for

        model = self._as_module()
        names = list_adapters(model)
        if not names:
            raise AttributeError(f"{type(model).__name__} holds no adapter: it has no peft_config")
        return {name: adapter_config_for(model, name) for name in names}

    @property
    def _hf_peft_config_loaded(self) -> bool:
        """transformers' flag for a model holding adapters: true while the model holds one. transformers
        reads it (gradient checkpointing, Trainer's check that a quantized model has something to train);
        a value assigned to it holds until another is assigned."""
        forced = self.__dict__.get("_loragen_peft_loaded")
        if forced is not None:
            return bool(forced)
        from loragen.adapters.named import list_adapters

        return bool(list_adapters(self._as_module()))

    @_hf_peft_config_loaded.setter
    def _hf_peft_config_loaded(self, value: bool) -> None:
        self.__dict__["_loragen_peft_loaded"] = bool(value)

    def load_adapter(
        self,
        peft_model_id: str | os.PathLike[str] | None = None,
        adapter_name: str | None = None,
        peft_config: Any = None,
        adapter_state_dict: Any = None,
        is_trainable: bool = False,
        hotswap: bool | str = "auto",
        adapter_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Load the adapter folder ``peft_model_id`` (``adapter_kwargs={"subfolder": ...}``: a folder inside
        it) as a new adapter ``adapter_name`` (default ``"default"``), not made active.

        As in transformers: ``is_trainable=False`` puts the model in eval mode with every parameter frozen;
        ``True`` makes the new factors train and their LoRA layers train mode. Hub keywords in
        ``adapter_kwargs`` (``revision``, ``token``, ...) are ignored for a local folder, as transformers does.

        Raises:
            AdapterNameError: the model holds an adapter of that name already.
            AdapterError: not a local folder, ``hotswap=True``, ``adapter_state_dict``/``peft_config``, an
                unknown ``adapter_kwargs`` key; see ``loragen.load_adapter``.
        """
        from loragen.adapters.load import load_adapter
        from loragen.adapters.named import list_adapters

        where = f"{type(self).__name__}.load_adapter"
        name = adapter_name or "default"
        if hotswap is True:
            raise _refuse(
                where,
                "hotswap=True",
                f"load new weights into an adapter with loragen.load_adapter(model, folder, adapter_name={name!r})",
            )
        if adapter_state_dict is not None or peft_config is not None:
            raise _refuse(
                where,
                "an adapter given as peft_config/adapter_state_dict",
                "save it as an adapter folder and pass the folder",
            )
        extra = dict(adapter_kwargs or {})
        subfolder = extra.pop("subfolder", None) or ""
        unknown = sorted(set(extra) - _HUB_KEYWORDS)
        if unknown:
            raise AdapterError(
                f"{where}: adapter_kwargs {unknown!r} are not understood; loragen reads a local folder and "
                f"takes 'subfolder' (and ignores the hub keywords {sorted(_HUB_KEYWORDS)!r})"
            )
        folder = None if peft_model_id is None else Path(peft_model_id) / subfolder
        if folder is None or not folder.is_dir():
            raise AdapterError(
                f"{where}: {str(folder) if folder else None!r} is not a local adapter folder; loragen loads "
                "folders (download one from the hub first, e.g. huggingface_hub.snapshot_download)"
            )
        model = self._as_module()
        if name in list_adapters(model):
            raise AdapterNameError(
                f"{where}: the model holds an adapter {name!r} already; pass another adapter_name, or load new "
                f"weights into it with loragen.load_adapter(model, {str(folder)!r}, adapter_name={name!r})"
            )
        with _enabled_while(model):
            load_adapter(model, folder, adapter_name=name, trainable=bool(is_trainable))

    def enable_peft_hotswap(self, target_rank: int = 128, check_compiled: str = "error") -> None:
        """Refused: transformers allows it only before the first adapter, and a loragen model holds one.

        Raises:
            AdapterError: always.
        """
        from loragen.adapters.named import list_adapters

        raise _refuse(
            f"{type(self).__name__}.enable_peft_hotswap",
            "hotswapping",
            "transformers allows enable_peft_hotswap only before the first adapter, and this model holds "
            f"adapters {list_adapters(self._as_module())}; load new weights into an adapter of the same ranks with "
            "loragen.load_adapter(model, folder, adapter_name=name)",
        )

    def add_adapter(self, adapter_config: Any, adapter_name: str | None = None) -> None:
        """Add a fresh adapter ``adapter_name`` (default ``"default"``) and make it the active one, as
        transformers' ``add_adapter`` does. ``adapter_config``: a loragen or a peft ``LoraConfig``.

        Raises:
            AdapterNameError: the name exists already or is not valid.
            AdapterError: the config is neither kind of ``LoraConfig``.
            LoraConfigError, LoraConversionError: see ``loragen.add_adapter``.
        """
        from loragen.adapters.named import add_adapter, set_adapter

        name = adapter_name or "default"
        where = f"{type(self).__name__}.add_adapter"
        config = adapter_config
        if not isinstance(config, LoraConfig):
            if not callable(getattr(config, "to_dict", None)):
                raise AdapterError(
                    f"{where}: expected a loragen.LoraConfig or a peft LoraConfig, got {type(config).__name__}"
                )
            config = LoraConfig.from_peft(config.to_dict(), source=f"{where}: {type(config).__name__}")
        model = self._as_module()
        with _enabled_while(model):
            add_adapter(model, config, name)
            set_adapter(model, name)

    def set_adapter(self, adapter_name: str | list[str]) -> None:
        """Make ``adapter_name`` the active adapter (its factors train, the others' are frozen).

        Raises:
            AdapterError: several names (loragen has one active adapter), or the model holds no adapter.
            AdapterNameError: an unknown name.
        """
        from loragen.adapters.named import set_adapter

        _require_adapters(self._as_module(), f"{type(self).__name__}.set_adapter")
        names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        if len(names) != 1:
            raise _refuse(
                f"{type(self).__name__}.set_adapter",
                f"several active adapters ({names!r})",
                "combine them into one with loragen.add_weighted_adapter(model, ...), or give each row its "
                "adapter with loragen.mixed_batch(model, names)",
            )
        with _enabled_while(self._as_module()):
            set_adapter(self._as_module(), names[0])

    def disable_adapters(self) -> None:
        """Compute the base model exactly until :meth:`enable_adapters` (merged layers are unmerged and
        merged again then); ``loragen.disable_adapter(model)`` is the context-manager form.

        Raises:
            AdapterError: the model holds no adapter (transformers' message).
        """
        from loragen.adapters.named import disable_adapter

        model = self._as_module()
        _require_adapters(model, f"{type(model).__name__}.disable_adapters")
        if model in _DISABLED:
            return
        context = disable_adapter(model)
        context.__enter__()
        _DISABLED[model] = context

    def enable_adapters(self) -> None:
        """Undo :meth:`disable_adapters` (nothing to do when the adapters are on).

        Raises:
            AdapterError: the model holds no adapter (transformers' message).
        """
        _require_adapters(self._as_module(), f"{type(self).__name__}.enable_adapters")
        context = _DISABLED.pop(self._as_module(), None)
        if context is not None:
            context.__exit__(None, None, None)

    def active_adapters(self) -> list[str]:
        """The active adapter's name in a list (transformers' form; loragen has one active adapter).

        Raises:
            AdapterError: the model holds no adapter (transformers' message).
        """
        from loragen.adapters.named import active_adapter

        model = self._as_module()
        names = _require_adapters(model, f"{type(model).__name__}.active_adapters")
        name = active_adapter(model)
        return [name if name is not None else names[0]]

    def active_adapter(self) -> str:
        """The active adapter's name: transformers 4's deprecated form of ``active_adapters()[0]``, with its
        ``FutureWarning``.

        Raises:
            AdapterError: the model holds no adapter.
        """
        warnings.warn(
            "The `active_adapter` method is deprecated and will be removed in a future version; use "
            "`active_adapters()`",
            FutureWarning,
            stacklevel=2,
        )
        return self.active_adapters()[0]

    def get_adapter_state_dict(
        self, adapter_name: str | None = None, state_dict: Any = None
    ) -> dict[str, Any]:
        """The tensors of adapter ``adapter_name`` (default: the active one) under transformers' keys: peft's
        file keys without ``base_model.model.``.

        Raises:
            AdapterError: the model holds no adapter (transformers' message).
            AdapterNameError: an unknown name.
        """
        from loragen.adapters.folder import PEFT_PREFIX
        from loragen.adapters.named import active_adapter, require_adapter
        from loragen.adapters.save import adapter_config_for, adapter_state_dict

        model = self._as_module()
        _require_adapters(model, f"{type(model).__name__}.get_adapter_state_dict")
        name = require_adapter(model, adapter_name if adapter_name is not None else active_adapter(model))
        config = adapter_config_for(model, name)
        tensors = adapter_state_dict(model, config, adapter_name=name, state_dict=state_dict)
        return {key.removeprefix(PEFT_PREFIX): value for key, value in tensors.items()}

    def delete_adapter(self, adapter_names: str | list[str] | None) -> None:
        """Delete the adapters ``adapter_names`` (each once; ``None`` or ``[]``: nothing), as transformers does;
        their ``modules_to_save`` stop training, as in peft.

        Raises:
            AdapterError: the model holds no adapter (transformers' message).
            AdapterNameError: a name the model does not hold (nothing is deleted then; transformers' message).
        """
        from loragen.adapters.named import delete_adapter

        model = self._as_module()
        where = f"{type(model).__name__}.delete_adapter"
        known = _require_adapters(model, where)
        if adapter_names is None:
            return
        names = list(dict.fromkeys([adapter_names] if isinstance(adapter_names, str) else adapter_names))
        missing = [name for name in names if name not in known]
        if missing:
            raise AdapterNameError(
                f"{where}: The following adapter(s) are not present and cannot be deleted: "
                f"{', '.join(map(str, missing))} (the model holds {', '.join(map(repr, known))})"
            )
        with _enabled_while(model):
            for name in names:
                delete_adapter(model, name)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike[str],
        *,
        full_model: bool = False,
        is_main_process: bool = True,
        state_dict: Any = None,
        selected_adapters: list[str] | None = None,
        save_embedding_layers: bool | str = "auto",
        safe_serialization: bool = True,
        **kwargs: Any,
    ) -> None:
        """Write the adapters to ``save_directory`` in peft's format with ``loragen.save_adapter``: the active
        one at the root (as transformers), the others in ``<name>/`` (as ``PeftModel.save_pretrained``); with
        ``selected_adapters``, peft's layout (``"default"`` at the root). ``state_dict`` (the model's keys,
        e.g. Trainer's gathered state) supplies the tensors.

        ``full_model=True``, or a model without LoRA layers (after ``merge_and_unload``): transformers' own
        save of the whole model, which takes every other keyword.

        Raises:
            AdapterError: a full-model-only keyword (``push_to_hub``, ...) without ``full_model=True``, or
                ``safe_serialization=False``.
        """
        from loragen.adapters.named import active_adapter
        from loragen.adapters.save import save_adapter
        from loragen.layers.adapter_set import DEFAULT_ADAPTER

        if full_model or not find_lora_layers(self._as_module()):
            base_save = super().save_pretrained  # type: ignore[misc]
            forced = self.__dict__.pop("_loragen_peft_loaded", None)
            self.__dict__["_loragen_peft_loaded"] = False  # transformers' full save, not its adapter save
            try:
                base_save(
                    save_directory,
                    is_main_process=is_main_process,
                    state_dict=state_dict,
                    safe_serialization=safe_serialization,
                    **kwargs,
                )
            finally:
                self.__dict__.pop("_loragen_peft_loaded", None)
                if forced is not None:
                    self.__dict__["_loragen_peft_loaded"] = forced
            return
        where = f"{type(self).__name__}.save_pretrained"
        if kwargs:
            raise _refuse(
                where,
                f"{', '.join(sorted(kwargs))} for an adapter save",
                "pass full_model=True to save the whole model with transformers, or call "
                "loragen.save_adapter(model, folder) for the adapter",
            )
        if not safe_serialization:
            raise _refuse(where, "safe_serialization=False", "adapters are written as safetensors only")
        if not is_main_process:
            return
        embedding: bool | Literal["auto"] = (
            save_embedding_layers if isinstance(save_embedding_layers, bool) else "auto"
        )
        model = self._as_module()
        active = active_adapter(model)
        save_adapter(
            model,
            save_directory,
            save_embedding_layers=embedding,
            state_dict=state_dict,
            selected_adapters=selected_adapters,
            root_adapter=active if selected_adapters is None and active is not None else DEFAULT_ADAPTER,
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle would find the transformers class by name: rebuild this subclass from it instead
        reduced = super().__reduce_ex__(protocol)
        if isinstance(reduced, tuple) and len(reduced) >= 2 and reduced[1][:1] == (type(self),):
            return (_rebuild, (self._loragen_base,), *reduced[2:])
        return reduced  # pragma: no cover - protocols 0/1 reduce differently; nn.Module state needs 2+

    def _as_module(self) -> nn.Module:
        return cast(nn.Module, self)  # mixed only into transformers' nn.Module classes (_subclass_for)


@contextmanager
def _enabled_while(model: nn.Module) -> Iterator[None]:
    """Adapters on for a change made while ``disable_adapters()`` is in force, and off again after it."""
    context = _DISABLED.pop(model, None)
    if context is None:
        yield
        return
    context.__exit__(None, None, None)
    try:
        yield
    finally:
        if find_lora_layers(model):
            LoragenAdapterMethods.disable_adapters(cast(Any, model))


@functools.cache
def _subclass_for(base: type) -> type:
    return type(
        base.__name__,
        (LoragenAdapterMethods, base),
        {"__module__": base.__module__, "__qualname__": base.__qualname__, "_loragen_base": base},
    )


def _rebuild(base: type) -> nn.Module:
    """A bare instance of ``base``'s loragen subclass, for unpickling (as pickle's ``__newobj__`` makes)."""
    return cast(nn.Module, object.__new__(_subclass_for(base)))


def install_adapter_methods(model: nn.Module) -> None:
    """Switch a transformers model that holds loragen LoRA layers to its class with loragen's adapter
    methods (see the module docstring); any other model, or one switched already, is left as it is."""
    if "transformers" not in sys.modules or isinstance(model, LoragenAdapterMethods):
        return  # without transformers imported, the model is not a transformers model
    try:
        from transformers.integrations import PeftAdapterMixin
    except ImportError:  # pragma: no cover - a transformers without the mixin has no adapter methods
        return
    if isinstance(model, PeftAdapterMixin) and find_lora_layers(model):
        model.__class__ = _subclass_for(cast(type, type(model)))


add_conversion_hook(install_adapter_methods)


# ---- Trainer checkpoints -------------------------------------------------------------------------------

# Trainer's names for the full-model weight files of a checkpoint (transformers.utils constants)
_MODEL_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _keep_only_trainable_weights(folder: Path, model: nn.Module) -> None:
    """Replace Trainer's full-model weight files in ``folder`` with the trainable tensors only."""
    from safetensors.torch import save_file

    from loragen.atomic import atomic_file

    for name in _MODEL_WEIGHT_FILES:
        path = folder / name
        if name.endswith(".index.json") and path.is_file():
            for shard in set(json.loads(path.read_text()).get("weight_map", {}).values()):
                (folder / shard).unlink(missing_ok=True)
        path.unlink(missing_ok=True)
    trainable = {
        name: p.detach().cpu().contiguous() for name, p in model.named_parameters() if p.requires_grad
    }
    with atomic_file(folder / "model.safetensors") as tmp:
        save_file(trainable, str(tmp), metadata={"format": "pt"})


_MISSING_PREFIX = (
    "There were missing keys in the checkpoint model loaded: "  # Trainer._issue_warnings_after_load
)
_TRAINER_LOGGER = "transformers.trainer"


class _ExactResumeFilter(logging.Filter):
    """Drops Trainer's "missing keys" warning when every missing key is a frozen tensor of the model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._model = weakref.ref(model)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        model = self._model()
        if model is None or not message.startswith(_MISSING_PREFIX):
            return True
        try:
            missing = ast.literal_eval(message[len(_MISSING_PREFIX) :].rstrip("."))
        except (ValueError, SyntaxError):
            return True
        if not isinstance(missing, (list, set, tuple)) or not missing:
            return True
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        frozen = set(model.state_dict()) - trainable
        return not all(isinstance(key, str) and key in frozen for key in missing)


def _lora_model(model: nn.Module | None) -> nn.Module:
    from loragen.training.distributed import unwrap_model

    if model is None:
        raise TrainingSetupError("LoraTrainerCallback: the Trainer passed no model to the callback")
    return unwrap_model(model)


@functools.cache
def make_trainer_callback_class() -> type:
    """The callback class, built on transformers' ``TrainerCallback`` (imported here, on first use).

    Raises:
        ImportError: transformers is not installed.
    """
    from transformers import TrainerCallback

    from loragen.adapters.named import active_adapter
    from loragen.adapters.save import save_adapter
    from loragen.layers.adapter_set import DEFAULT_ADAPTER

    class LoraTrainerCallback(TrainerCallback):
        """Writes the peft adapter, and what resuming needs, into every Trainer checkpoint.

        Args:
            full_model: write the whole model into each checkpoint; by default only what trains.
        """

        def __init__(self, full_model: bool = False) -> None:
            self.full_model = bool(full_model)
            self._filter: _ExactResumeFilter | None = None

        def on_init_end(
            self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any
        ) -> None:
            if not self.full_model and model is not None and self._filter is None:
                self._filter = _ExactResumeFilter(_lora_model(model))
                logging.getLogger(_TRAINER_LOGGER).addFilter(self._filter)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self._filter is not None:
                logging.getLogger(_TRAINER_LOGGER).removeFilter(self._filter)
                self._filter = None

        def on_save(
            self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any
        ) -> None:
            if not state.is_world_process_zero:
                return
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            lora_model = _lora_model(model)
            save_adapter(lora_model, folder, root_adapter=active_adapter(lora_model) or DEFAULT_ADAPTER)
            if not self.full_model:
                _keep_only_trainable_weights(folder, lora_model)
            elif isinstance(lora_model, LoragenAdapterMethods) and not any(
                (folder / name).is_file() for name in _MODEL_WEIGHT_FILES
            ):  # save_pretrained wrote the adapter (peft's semantics): add the full model
                lora_model.save_pretrained(folder, full_model=True)

    LoraTrainerCallback.__module__ = "loragen"
    LoraTrainerCallback.__qualname__ = "LoraTrainerCallback"
    return LoraTrainerCallback


def __getattr__(name: str) -> Any:
    if name == "LoraTrainerCallback":
        return make_trainer_callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

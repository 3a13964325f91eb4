"""loragen in transformers: a loragen model's adapter methods, and its adapter in every Trainer checkpoint.

**Adapter methods.** transformers' adapter methods on a loragen model act on loragen's adapters, with
peft's semantics.

A transformers ``PreTrainedModel`` carries ``PeftAdapterMixin``'s methods (``load_adapter``,
``add_adapter``, ``set_adapter``, ``save_pretrained`` ...). They drive peft: on a model loragen converted
they would wrap loragen's LoRA layers in peft layers (two adapters stacked), fail on a version check, or
save the whole model. Once a transformers model holds loragen LoRA layers (``get_lora_model``,
``load_adapter``, ``add_adapter``, a decorated class's ``get_lora_model``, ``mark_trainable`` on a
rewritten model) its class is switched to a subclass made for it here, with the same name, whose adapter
methods call loragen's functions:

==================================== ====================================================================
``load_adapter(folder, name)``        ``loragen.load_adapter(model, folder, adapter_name=name)``; a new
                                      name is added beside the others (not made active), as transformers
                                      does; an existing name is refused (transformers refuses it too);
                                      ``adapter_kwargs={"subfolder": ...}`` reads a folder inside it;
                                      ``is_trainable=False``: eval mode, all frozen; ``True``: the new
                                      LoRA layers in train mode, their factors trainable
``add_adapter(config, name)``         ``loragen.add_adapter`` then ``loragen.set_adapter`` (transformers
                                      activates it); a peft ``LoraConfig`` is read with ``from_peft``
``set_adapter(name)``                 ``loragen.set_adapter``
``disable_adapters()`` /              ``loragen.disable_adapter(model)`` entered / left: the base model
``enable_adapters()``                 exactly in between
``active_adapters()``                 ``[loragen.active_adapter(model)]``
``get_adapter_state_dict(name)``      the adapter's tensors under transformers' keys (peft's file keys
                                      without ``base_model.model.``)
``delete_adapter(names)``             ``loragen.delete_adapter`` for each name once; the deleted
                                      adapter's ``modules_to_save`` stop training, as in peft
``save_pretrained(folder)``           ``loragen.save_adapter``: the adapter folder, the active adapter at
                                      the root (as transformers), the others in ``<name>/`` (as
                                      ``PeftModel.save_pretrained``), ``base_model_name_or_path`` the
                                      model's ``name_or_path``; ``full_model=True`` keeps transformers'
                                      full-model save (config, base and LoRA weights)
``enable_peft_hotswap()``             refused: transformers allows it before the first adapter only
==================================== ====================================================================

What cannot match raises an :class:`~loragen.errors.AdapterError` naming the loragen call to use.
A subclass and not per-instance methods: the instance stays free of bound methods (``copy.deepcopy``,
``torch.save`` and pickling work), and ``isinstance`` and ``type(model).__name__`` (which transformers
writes into ``config.architectures``) are unchanged.

**Trainer checkpoints.** Trainer's own save of a checkpoint, and ``trainer.save_model()``, call
``save_pretrained``: they write the adapter, as for a peft model. Trainer resumes a model that is not a
``PeftModel`` only from a model weights file, though, and ``LoraTrainerCallback`` adds one to every
``checkpoint-<step>``: by default a ``model.safetensors`` holding only what trains (LoRA factors,
``modules_to_save``, trained biases) under the model's parameter names, so a checkpoint holds nothing of the
frozen base, as a peft user's does; with ``full_model=True`` the whole model (``model.safetensors``,
``config.json``). Resuming is exact either way: Trainer loads the file non-strictly, the frozen base weights
stay as they are in the model, and the callback drops Trainer's "missing keys" warning when every missing
key is a frozen tensor.

transformers is imported only for a model that is a transformers model already, and for the callback class
when it is first used.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import sys
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

# the subclass made for each transformers class
_SUBCLASSES: dict[type, type] = {}
# disable_adapters() holds loragen's disable_adapter context open until enable_adapters()
_DISABLED: weakref.WeakKeyDictionary[nn.Module, AbstractContextManager[Any]] = weakref.WeakKeyDictionary()


def _peft_adapter_mixin() -> type | None:
    if "transformers" not in sys.modules:
        return None  # the model cannot be a transformers model then
    try:
        from transformers.integrations import PeftAdapterMixin
    except ImportError:  # pragma: no cover - a transformers without the mixin has no adapter methods
        return None
    mixin: type = PeftAdapterMixin
    return mixin


def _lora_config(config: Any, where: str) -> LoraConfig:
    """A loragen config from a loragen or a peft ``LoraConfig``."""
    if isinstance(config, LoraConfig):
        return config
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return LoraConfig.from_peft(to_dict(), source=f"{where}: {type(config).__name__}")
    raise AdapterError(
        f"{where}: expected a loragen.LoraConfig or a peft LoraConfig, got {type(config).__name__}"
    )


# transformers' download keywords: meaningless for a local folder, which transformers reads without them
_HUB_KEYWORDS = frozenset(
    {"revision", "token", "cache_dir", "local_files_only", "force_download", "proxies", "user_agent"}
)


def _refuse(where: str, what: str, instead: str) -> LoraError:
    return AdapterError(f"{where}: {what} is not supported on a loragen model; {instead}")


class LoragenAdapterMethods:
    """The adapter methods of a loragen model's transformers class (see the module docstring)."""

    _loragen_base: type

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
        it) as adapter ``adapter_name`` (default ``"default"``).

        A name the model does not hold yet is added beside its adapters and not made active. As in
        transformers: ``is_trainable=False`` puts the model in eval mode with every parameter frozen;
        ``is_trainable=True`` makes the new factors train and puts the LoRA layers holding them in train
        mode. Hub keywords in ``adapter_kwargs`` (``revision``, ``token``, ...) do not apply to a local folder
        and are ignored, as transformers ignores them for one.

        Raises:
            AdapterNameError: the model holds an adapter of that name already (transformers refuses it too;
                ``loragen.load_adapter(model, folder, adapter_name=name)`` loads new weights into it).
            AdapterError: not a local folder (hub ids: download the folder first), ``hotswap=True``,
                ``adapter_state_dict``/``peft_config`` without a folder, an ``adapter_kwargs`` key other than
                ``subfolder`` and the hub keywords; see ``loragen.load_adapter``.
        """
        from loragen.adapters.load import load_adapter
        from loragen.adapters.named import list_adapters
        from loragen.layers.adapter_set import has_adapter

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
        if not is_trainable:
            model.eval()
            return
        for layer in find_lora_layers(model).values():
            if has_adapter(layer, name):
                layer.train()

    def enable_peft_hotswap(self, target_rank: int = 128, check_compiled: str = "error") -> None:
        """Refused: transformers allows it only before the first adapter, and a loragen model holds one.

        Raises:
            AdapterError: always; it names the loragen call that replaces an adapter's weights in place.
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
        config = _lora_config(adapter_config, f"{type(self).__name__}.add_adapter")
        model = self._as_module()
        with _enabled_while(model):
            add_adapter(model, config, name)
            set_adapter(model, name)

    def set_adapter(self, adapter_name: str | list[str]) -> None:
        """Make ``adapter_name`` the active adapter (its factors train, the others' are frozen).

        Raises:
            AdapterError: several names (loragen adds one adapter at a time: combine them with
                ``loragen.add_weighted_adapter``, or route rows with ``loragen.mixed_batch``).
            AdapterNameError: an unknown name.
        """
        from loragen.adapters.named import set_adapter

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
        merged again then); ``loragen.disable_adapter(model)`` is the context-manager form."""
        from loragen.adapters.named import disable_adapter

        model = self._as_module()
        if model in _DISABLED:
            return
        context = disable_adapter(model)
        context.__enter__()
        _DISABLED[model] = context

    def enable_adapters(self) -> None:
        """Undo :meth:`disable_adapters` (nothing to do when the adapters are on)."""
        context = _DISABLED.pop(self._as_module(), None)
        if context is not None:
            context.__exit__(None, None, None)

    def active_adapters(self) -> list[str]:
        """The active adapter's name in a list (transformers' form; loragen has one active adapter)."""
        from loragen.adapters.named import active_adapter

        name = active_adapter(self._as_module())
        return [] if name is None else [name]

    def get_adapter_state_dict(
        self, adapter_name: str | None = None, state_dict: Any = None
    ) -> dict[str, Any]:
        """The tensors of adapter ``adapter_name`` (default: the active one) under transformers' keys: peft's
        file keys without ``base_model.model.`` (``model.layers.0.self_attn.q_proj.lora_A.weight``).

        Raises:
            AdapterNameError: an unknown name.
        """
        from loragen.adapters.folder import PEFT_PREFIX
        from loragen.adapters.named import active_adapter, require_adapter
        from loragen.adapters.save import adapter_config_for, adapter_state_dict

        model = self._as_module()
        name = require_adapter(model, adapter_name if adapter_name is not None else active_adapter(model))
        config = adapter_config_for(model, name)
        tensors = adapter_state_dict(model, config, adapter_name=name, state_dict=state_dict)
        return {key.removeprefix(PEFT_PREFIX): value for key, value in tensors.items()}

    def delete_adapter(self, adapter_names: str | list[str] | None) -> None:
        """Delete the adapters ``adapter_names`` (each once; ``None`` or ``[]``: nothing), as transformers does.

        What a deleted adapter trained in full (``modules_to_save``) is frozen again, as in peft: with no
        adapter left, nothing trains.

        Raises:
            AdapterNameError: a name the model does not hold (nothing is deleted then).
        """
        from loragen.adapters.named import adapter_configs, delete_adapter, require_adapter

        model = self._as_module()
        if adapter_names is None:
            return
        names = list(dict.fromkeys([adapter_names] if isinstance(adapter_names, str) else adapter_names))
        for name in names:
            require_adapter(model, name)
        configs = adapter_configs(model)
        with _enabled_while(model):
            for name in names:
                delete_adapter(model, name)
        for name in names:
            config = configs.get(name)
            if config is None or not config.modules_to_save:
                continue
            for path, module in model.named_modules():
                if path and config.is_module_to_save(path):
                    module.requires_grad_(False)

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
        """Write the adapters to ``save_directory`` in peft's format (``loragen.save_adapter``: the folder loads
        in ``PeftModel.from_pretrained``, ``loragen.load_adapter`` and ``AutoModel*.from_pretrained``).

        The active adapter goes at the root, as transformers saves it, and every other adapter in its
        ``<name>/`` subfolder, as ``PeftModel.save_pretrained`` saves it; with ``selected_adapters``, peft's
        layout (``"default"`` at the root).

        ``full_model=True``, or a model without LoRA layers (after ``loragen.merge_and_unload``, as peft's
        ``merge_and_unload`` returns the plain model): transformers' own save of the whole model (every other
        keyword goes to it). ``state_dict`` (the model's keys, e.g. Trainer's gathered state) supplies the
        tensors.

        Raises:
            AdapterError: a keyword only the full-model save takes (``push_to_hub``, ``max_shard_size``,
                ...) without ``full_model=True``, or ``safe_serialization=False`` (adapters are safetensors).
        """
        from loragen.adapters.named import active_adapter
        from loragen.adapters.save import save_adapter
        from loragen.layers.adapter_set import DEFAULT_ADAPTER

        if full_model or not find_lora_layers(self._as_module()):
            base_save = super().save_pretrained  # type: ignore[misc]
            base_save(
                save_directory,
                is_main_process=is_main_process,
                state_dict=state_dict,
                safe_serialization=safe_serialization,
                **kwargs,
            )
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
        # pickle names classes by module and qualified name, which find the transformers class: rebuild
        # this subclass from it instead
        reduced = super().__reduce_ex__(protocol)
        if isinstance(reduced, tuple) and len(reduced) >= 2 and reduced[1][:1] == (type(self),):
            return (_rebuild, (self._loragen_base,), *reduced[2:])
        return reduced  # pragma: no cover - protocols 0/1 reduce differently; nn.Module state needs 2+

    def _as_module(self) -> nn.Module:
        return cast(nn.Module, self)  # mixed only into transformers' nn.Module classes (_subclass_for)


@contextmanager
def _enabled_while(model: nn.Module) -> Iterator[None]:
    """Adapters switched on for a change made while ``disable_adapters()`` is in force, and off again
    after it: the disabled state restores what was active when it began, which the change may alter."""
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


def _subclass_for(base: type) -> type:
    sub = _SUBCLASSES.get(base)
    if sub is None:
        sub = type(
            base.__name__,
            (LoragenAdapterMethods, base),
            {"__module__": base.__module__, "__qualname__": base.__qualname__, "_loragen_base": base},
        )
        _SUBCLASSES[base] = sub
    return sub


def _rebuild(base: type) -> nn.Module:
    """A bare instance of ``base``'s loragen subclass, for unpickling."""
    sub = _subclass_for(base)
    return cast(nn.Module, object.__new__(sub))  # what pickle's copyreg.__newobj__ does for the class


def install_adapter_methods(model: nn.Module) -> None:
    """Switch a transformers model that holds loragen LoRA layers to its class with loragen's adapter
    methods (see the module docstring); any other model, or one switched already, is left as it is."""
    mixin = _peft_adapter_mixin()
    if mixin is None or not isinstance(model, mixin) or isinstance(model, LoragenAdapterMethods):
        return
    if not find_lora_layers(model):
        return
    model.__class__ = _subclass_for(type(model))


add_conversion_hook(install_adapter_methods)


# ---- Trainer checkpoints -------------------------------------------------------------------------------

# Trainer's names for the full-model weight files of a checkpoint (transformers.utils constants)
_MODEL_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _checkpoint_dir(output_dir: str, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


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
    """Drops Trainer's "missing keys" warning when every missing key is a frozen tensor of the model (a
    checkpoint without ``full_model`` leaves exactly those out on purpose); any other record passes."""

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
        """Writes the peft adapter, and what resuming needs, into every Trainer checkpoint (see
        :mod:`loragen.training.transformers_integration`).

        Args:
            full_model: write the whole model into each checkpoint; by default a checkpoint holds only what
                trains (the adapter, and the trainable tensors under the model's names for resuming).
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
            folder = _checkpoint_dir(args.output_dir, state.global_step)
            lora_model = _lora_model(model)
            save_adapter(lora_model, folder, root_adapter=active_adapter(lora_model) or DEFAULT_ADAPTER)
            if not self.full_model:
                _keep_only_trainable_weights(folder, lora_model)
            elif not any((folder / name).is_file() for name in _MODEL_WEIGHT_FILES):
                # save_pretrained wrote the adapter (peft's semantics): add the full model
                if isinstance(lora_model, LoragenAdapterMethods):
                    lora_model.save_pretrained(folder, full_model=True)

    LoraTrainerCallback.__module__ = "loragen"
    LoraTrainerCallback.__qualname__ = "LoraTrainerCallback"
    return LoraTrainerCallback


_class: type | None = None


def __getattr__(name: str) -> Any:
    global _class
    if name == "LoraTrainerCallback":
        if _class is None:
            _class = make_trainer_callback_class()
        return _class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

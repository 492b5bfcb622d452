"""Learned absolute families (BERT, GPT-2): the position table becomes torchembed's.

``BertEmbeddings.position_embeddings`` and ``GPT2Model.wpe`` (``nn.Embedding``) become :class:`HFPositionTable`, a
:class:`~torchembed.positional.LearnedPositionalEmbedding` holding the very same ``weight`` Parameter (``state_dict``
keys and values unchanged), called as upstream calls the table (with position ids). Positions past the table raise a
``ValueError`` naming the table length instead of an index error deep inside ``F.embedding``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from torchembed.patches.actions import Component, SwapModule
from torchembed.patches.adapters import modules_of
from torchembed.patches.errors import StructureError
from torchembed.patches.registry import Family, PatchOptions, register
from torchembed.positional.learned import LearnedPositionalEmbedding

__all__ = ["HFPositionTable"]


class HFPositionTable(LearnedPositionalEmbedding, nn.Embedding):
    """``LearnedPositionalEmbedding`` called like ``nn.Embedding``: ``(position_ids) -> (..., d)``.

    It is also an ``nn.Embedding`` (same attributes as the table it replaces), so what HF and PEFT do with embeddings
    (``_init_weights``, ``init_weights``, adapters that target embedding modules) treats it as upstream's table.
    """

    @classmethod
    def from_embedding(cls, table: nn.Embedding, dropout: float = 0.0) -> "HFPositionTable":
        module = super().from_embedding(table, dropout)
        module.num_embeddings, module.embedding_dim = table.num_embeddings, table.embedding_dim
        module.max_norm, module.norm_type = table.max_norm, table.norm_type
        module.scale_grad_by_freq, module.sparse = table.scale_grad_by_freq, table.sparse
        if getattr(table, "_is_hf_initialized", False):  # HF's init skips what it initialised already
            module._is_hf_initialized = True
        return module

    def forward(self, position_ids: Tensor) -> Tensor:  # type: ignore[override]
        return self.lookup(position_ids)


class SwapPositionTable:
    """Replace ``attr`` (an ``nn.Embedding``) of every module of ``class_name`` (or a subclass)."""

    def __init__(self, class_name: str, attr: str) -> None:
        self.class_name, self.attr = class_name, attr

    def plan(self, model: nn.Module, config: Any, options: PatchOptions, family: Family) -> list[SwapModule]:
        actions = []
        for path, module in modules_of(model, self.class_name):
            table = getattr(module, self.attr, None)
            full = f"{path}.{self.attr}" if path else self.attr
            replacement = f"{HFPositionTable.__module__}.HFPositionTable"
            if isinstance(table, HFPositionTable):  # a base model patched on its own inside this one: kept
                component = Component(full, "learned", f"{replacement} (of the patched base model)", replacement)
                actions.append(SwapModule(component, module, self.attr, table))
                continue
            if not isinstance(table, nn.Embedding):
                raise StructureError(family.name, f"{type(module).__qualname__}.{self.attr}",
                                     "an nn.Embedding position table", type(table).__name__)
            component = Component(full, "learned", "torch.nn.Embedding", replacement)
            actions.append(SwapModule(component, module, self.attr, HFPositionTable.from_embedding(table)))
        if not actions:
            raise StructureError(family.name, type(model).__name__, f"a {self.class_name} module with a position table "
                                 f"`{self.attr}`", "none")
        return actions


for _model_type, _class_name, _attr, _where in (("bert", "BertEmbeddings", "position_embeddings", "embeddings.position_embeddings"),
                                               ("gpt2", "GPT2Model", "wpe", "wpe")):
    register(Family(model_type=_model_type, encoding="learned", adapters=(SwapPositionTable(_class_name, _attr),),
                    description=f"{_where} -> LearnedPositionalEmbedding (same weight)"))

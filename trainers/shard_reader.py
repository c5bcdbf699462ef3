"""Reading torch.distributed.checkpoint shards without running code from them.

DCP's own reader unpickles `.metadata` with `pickle.load`, and its default planner reads each non-tensor
item with `torch.load(weights_only=False)`: either runs whatever a crafted file names. A checkpoint's
manifest (quaero/recipe/checkpoint.py) says a file is the one listed, not that its writer was benign: whoever
can write the folder can rewrite the manifest too. So shards are read here with an allowlist unpickler for
the metadata (DCP's metadata dataclasses, torch.Size, dtypes, layouts, paths: data, never a callable that
acts) and `weights_only=True` for the items, and every file the metadata names must lie in the shards
folder.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path, PurePath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem


def _allowed() -> dict[tuple[str, str], Any]:
    classes = {(metadata.__name__, name): obj for name, obj in vars(metadata).items()
               if isinstance(obj, type) and obj.__module__ == metadata.__name__}  # its dataclasses and enums
    classes[(_StorageInfo.__module__, "_StorageInfo")] = _StorageInfo
    classes[("torch", "Size")] = torch.Size
    # a name -> torch.layout lookup
    classes[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name, obj in vars(torch).items():
        if isinstance(obj, (torch.dtype, torch.memory_format)):
            classes[("torch", name)] = obj
    for cls in (PurePath, Path, type(Path()), type(PurePath())):
        classes[(cls.__module__, cls.__name__)] = cls
    return classes


class _MetadataUnpickler(pickle.Unpickler):
    allowed = _allowed()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"shard metadata names {module}.{name}, which is not checkpoint "
                                         "metadata (a crafted file?); refused") from None


class SafeShardReader(FileSystemReader):
    """`FileSystemReader` whose metadata is unpickled through the allowlist and whose data files all lie in
    its own folder."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> metadata.Metadata:
        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
            md = _MetadataUnpickler(f).load()
        if not isinstance(md, metadata.Metadata):
            raise pickle.UnpicklingError(f"shard metadata is a {type(md).__name__}, not DCP Metadata")
        for info in (md.storage_data or {}).values():
            rel = PurePath(getattr(info, "relative_path", ""))
            if rel.is_absolute() or len(rel.parts) != 1 or rel.name in ("", ".", ".."):
                raise pickle.UnpicklingError(f"shard metadata names a file outside its folder ({str(rel)!r})")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` reading non-tensor items (optimizer hyperparameters) with `weights_only=True`
    (the parent's `load_bytes`, that one argument changed)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded

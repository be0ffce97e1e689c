"""A torch.distributed.checkpoint (DCP) storage that never pickles: tensors in safetensors, the index
in JSON.

DCP's FileSystemWriter pickles its index (`.metadata`) and any non-tensor value, and its reader
unpickles them, so a crafted checkpoint could run code when it loads. `SafetensorsWriter` writes
each rank's chunks to `rank<N>.safetensors` and, on the coordinator, the index (each tensor's dtype,
size and chunks, and where each chunk lies) to `index.json`; it refuses non-tensor values.
`SafetensorsReader` reads them back for DCP's resharding load planner from an index its caller has
validated (flowrl.distributed.sharded_checkpoint.check_sharded_folder). It knows DCP's storage
interface, nothing of what the tensors are.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future


def _chunk_key(fqn: str, offsets) -> str:
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


class SafetensorsWriter(StorageWriter):
    """DCP storage that writes each rank's chunks to rank<N>.safetensors and the index as JSON, to
    the file `index_file` under the tag `index_format` (the caller's names: it checks them on read,
    flowrl.distributed.sharded_checkpoint.check_sharded_folder)."""

    def __init__(self, path: str | Path, index_file: str, index_format: str):
        super().__init__()
        self.path = Path(path)
        self.index_file, self.index_format = index_file, index_format

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.path.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=f"rank{rank}.safetensors") for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner) -> Future:
        tensors, results = {}, []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise ValueError(f"sharded checkpoint: {item.index.fqn} is not a tensor; only tensors are written here")
            key = _chunk_key(item.index.fqn, item.index.offset or ())
            # A copy of its own: safetensors refuses tensors that share storage (views of a flat shard).
            tensors[key] = planner.resolve_data(item).detach().to("cpu").contiguous().clone()
            size = tensors[key].numel() * tensors[key].element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=(plan.storage_data, key)))
        if tensors:
            save_file(tensors, str(self.path / plan.storage_data))
        future: Future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        where = {result.index: result.storage_data for rank in results for result in rank}
        entries = {}
        for fqn, meta in metadata.state_dict_metadata.items():
            if not isinstance(meta, TensorStorageMetadata):
                raise ValueError(f"sharded checkpoint: {fqn} is not a tensor; only tensors are written here")
            chunks = []
            for chunk in meta.chunks:
                file, key = where[MetadataIndex(fqn, chunk.offsets)]
                chunks.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes), "file": file, "key": key})
            dtype = str(meta.properties.dtype).removeprefix("torch.")
            entries[fqn] = {"dtype": dtype, "size": list(meta.size), "chunks": chunks}
        index = {"format": self.index_format, "tensors": entries}
        (self.path / self.index_file).write_text(json.dumps(index, indent=1))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


class SafetensorsReader(StorageReader):
    """DCP storage that reads what SafetensorsWriter wrote; `tensors` is its index, validated by
    the caller (flowrl.distributed.sharded_checkpoint.check_sharded_folder). Never unpickles."""

    def __init__(self, path: str | Path, tensors: dict):
        super().__init__()
        self.path = Path(path)
        self.tensors = tensors
        self.storage_data: dict = {}

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        state, storage = {}, {}
        for fqn, entry in self.tensors.items():
            chunks = [ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])) for c in entry["chunks"]]
            properties = TensorProperties(dtype=getattr(torch, entry["dtype"]))
            state[fqn] = TensorStorageMetadata(properties, torch.Size(entry["size"]), chunks)
            for chunk in entry["chunks"]:
                storage[MetadataIndex(fqn, torch.Size(chunk["offsets"]))] = (chunk["file"], chunk["key"])
        return Metadata(state_dict_metadata=state, storage_data=storage, storage_meta=StorageMeta())

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner) -> Future:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        by_file: dict[str, list] = {}
        for request in plan.items:
            if request.type == LoadItemType.BYTE_IO:
                raise ValueError(f"sharded checkpoint: {request.storage_index.fqn} is not a tensor in {self.path}")
            file, key = self.storage_data[request.storage_index]
            by_file.setdefault(file, []).append((request, key))
        for file, requests in by_file.items():
            with safe_open(str(self.path / file), framework="pt") as handle:
                for request, key in requests:
                    tensor = narrow_tensor_by_index(handle.get_tensor(key), request.storage_offsets, request.lengths)
                    target = planner.resolve_tensor(request).detach()
                    if target.size() != tensor.size():
                        raise ValueError(
                            f"sharded checkpoint {self.path}: {key} in {file} has shape {tuple(tensor.shape)}, "
                            f"the index says {tuple(target.shape)} (damaged)"
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(request, target)
        future: Future = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

"""The attention registry: the platform chooses a backend per attention kind; backends declare their KV views."""

from __future__ import annotations

import pytest
import torch

from mrv2.attention import AttentionBackend, get_attention_backend, registered_backends
from mrv2.attention import paged_decode, registry
from mrv2.attention.cpp_paged import CppPagedAttention
from mrv2.attention.paged_decode import InductorPagedAttention
from mrv2.attention.torch_mla import TorchMLAAttention
from mrv2.attention.torch_paged import TorchPagedAttention
from mrv2.kv_spec import KVCacheSpec, KVPart
from mrv2.platforms import CpuPlatform, CudaPlatform, NpuPlatform, cpu
from mrv2.runner.kv_cache import allocate_kv_cache

PLATFORMS = [CpuPlatform, CudaPlatform, NpuPlatform]  # constructing one needs no device


@pytest.mark.parametrize("platform_cls, kind, expected", [
    (CpuPlatform, "gqa", CppPagedAttention), (CpuPlatform, "mla", TorchMLAAttention),
    (CudaPlatform, "gqa", TorchPagedAttention), (CudaPlatform, "mla", TorchMLAAttention),
    (NpuPlatform, "gqa", TorchPagedAttention), (NpuPlatform, "mla", TorchMLAAttention)])
def test_each_platform_chooses_its_backends(platform_cls, kind, expected):
    backend = get_attention_backend(platform_cls(), kind)
    assert type(backend) is expected and backend.kind == kind


def test_the_cpu_falls_back_to_gathering_without_a_compiler(monkeypatch):
    monkeypatch.setattr(cpu, "load_cpu_kernels", lambda: "RuntimeError: no C++ compiler")
    assert type(get_attention_backend(CpuPlatform(), "gqa")) is InductorPagedAttention
    monkeypatch.setattr(paged_decode.shutil, "which", lambda name: None)
    assert type(get_attention_backend(CpuPlatform(), "gqa")) is TorchPagedAttention


def test_a_backend_chosen_by_name():
    assert type(get_attention_backend(CpuPlatform(), "gqa", name="torch")) is TorchPagedAttention
    with pytest.raises(ValueError, match=r"'flash' is not registered \(registered: \[.*'inductor-paged'"):
        get_attention_backend(CpuPlatform(), "gqa", name="flash")
    with pytest.raises(ValueError, match=r"'torch-mla' serves 'mla' attention, but this model needs 'gqa'"):
        get_attention_backend(CpuPlatform(), "gqa", name="torch-mla")


def test_each_call_returns_a_fresh_instance():
    # Backends carry per-engine state (e.g. MLA's absorbed switches): never shared.
    p = CpuPlatform()
    assert get_attention_backend(p, "mla") is not get_attention_backend(p, "mla")


def test_unknown_kind_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"one of \['gqa', 'mla'\], got 'mha'"):
        get_attention_backend(CpuPlatform(), "mha")


class _Fast(TorchPagedAttention):
    name = "test-fast"


class _Unavailable(TorchPagedAttention):
    name = "test-unavailable"

    @classmethod
    def is_available(cls) -> bool:
        return False


class _Preferring(CpuPlatform):
    attention_backends = {"gqa": ("test-missing", "test-unavailable", "test-fast", "torch"), "mla": ("torch-mla",)}


@pytest.fixture
def fakes(monkeypatch):
    registered_backends()  # built-ins first, so that the patch below undoes only the fakes
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    registry.register_backend(_Fast)
    registry.register_backend(_Unavailable)


def test_the_platform_prefers_the_first_registered_available_backend(fakes):
    assert type(get_attention_backend(_Preferring(), "gqa")) is _Fast
    assert type(get_attention_backend(_Preferring(), "mla")) is TorchMLAAttention
    assert type(get_attention_backend(CpuPlatform(), "gqa")) is CppPagedAttention


def test_no_available_backend_says_what_was_tried(fakes):
    class OnlyUnavailable(CpuPlatform):
        attention_backends = {"gqa": ("test-unavailable", "torch-mla")}  # torch-mla is the wrong kind

    with pytest.raises(ValueError, match=r"no available 'gqa'.*test-unavailable.*registered: .*'torch'"):
        get_attention_backend(OnlyUnavailable(), "gqa")


def test_a_name_is_registered_once(fakes):
    class Impostor(TorchPagedAttention):
        name = "torch"

    with pytest.raises(ValueError, match="taken by TorchPagedAttention"):
        registry.register_backend(Impostor)


SPECS = {
    "gqa": KVCacheSpec.gqa(num_kv_heads=3, head_dim=16, v_head_dim=8, dtype=torch.float32),
    "mla": KVCacheSpec((KVPart("latent", 1, 32), KVPart("rope", 1, 8)), torch.bfloat16),
}
NUM_BLOCKS, BLOCK_SIZE = 5, 4


def _cases():
    for name, cls in sorted(registered_backends().items()):
        for layout in cls.supported_layouts:
            yield pytest.param(cls, layout, id=f"{name}-{layout}")


@pytest.mark.parametrize("cls,layout", list(_cases()))
def test_declared_kv_shape_and_stride_order_match_the_allocators_views(cls: type[AttentionBackend], layout):
    spec = SPECS[cls.kind]
    cache = allocate_kv_cache([spec], layout, NUM_BLOCKS, BLOCK_SIZE, 64, torch.device("cpu")).layers[0]
    order = cls.get_kv_cache_stride_order(layout)
    assert sorted(order) == [0, 1, 2, 3]
    for part in spec.parts:
        view = cache[part.name]
        assert tuple(view.shape) == cls.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, part.num_heads, part.head_dim)
        strides = [view.stride(d) for d in order]
        assert strides == sorted(strides, reverse=True), f"{part.name}: strides {view.stride()} vs order {order}"
        if layout == "split":
            assert view.permute(order).is_contiguous()
        else:
            assert cache.joint.shape == (NUM_BLOCKS, BLOCK_SIZE, spec.width)
            assert view.untyped_storage().data_ptr() == cache.joint.untyped_storage().data_ptr()
            assert view.stride(1) == spec.width  # a token's parts sit side by side

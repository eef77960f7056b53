"""LoRA over gRPC (services/gateway/grpc/server.py): Admin.LoadLoraAdapter and
UnloadLoraAdapter behind the admin token, ListModels with the adapters, and Generate's
`model` selecting one, against the fake engine."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from proto import shuttle_pb2 as pb
from proto import shuttle_pb2_grpc as pb_grpc
from tests.fake_engine import MODEL, FakeEngine
from tests.unit.services.gateway.grpc.test_server import TOKEN, generate, run

Code = grpc.StatusCode
META = (("authorization", f"Bearer {TOKEN}"),)


def test_load_list_generate_unload(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    engine = FakeEngine()
    engine.lora_enabled = True

    async def test(channel: grpc.aio.Channel) -> None:
        admin, shuttle = pb_grpc.AdminStub(channel), pb_grpc.ShuttleStub(channel)
        load = pb.LoadLoraAdapterRequest(lora_name="sql", lora_path=str(tmp_path))
        loaded = await admin.LoadLoraAdapter(load, metadata=META)
        assert (loaded.weights_hash, loaded.rank) == ("h", 8)
        with pytest.raises(grpc.aio.AioRpcError) as info:  # twice: refused, naming why
            await admin.LoadLoraAdapter(load, metadata=META)
        assert info.value.code() == Code.INVALID_ARGUMENT
        models = (await shuttle.ListModels(pb.ListModelsRequest())).models
        assert [(m.id, m.parent, m.root) for m in models] == [
            (MODEL, "", ""),
            ("sql", MODEL, str(tmp_path)),
        ]
        await generate(channel, model="sql", text="hi")
        assert engine.requests[-1].lora_name == "sql"
        await admin.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="sql"), metadata=META)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(channel, model="sql", text="hi")
        assert info.value.code() == Code.NOT_FOUND

    run(engine, test, admin_token=TOKEN)


def test_without_enable_lora_or_token_the_rpcs_refuse() -> None:
    async def test(channel: grpc.aio.Channel) -> None:
        admin = pb_grpc.AdminStub(channel)
        request = pb.UnloadLoraAdapterRequest(lora_name="sql")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await admin.UnloadLoraAdapter(request, metadata=META)
        assert info.value.code() == Code.NOT_FOUND and "--enable-lora" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await admin.UnloadLoraAdapter(request)
        assert info.value.code() == Code.UNAUTHENTICATED

    run(FakeEngine(), test, admin_token=TOKEN)

"""A Megatron-core trainer at TP=2 pushes its full weights into an engine: two gloo ranks, rank 0 sends."""

import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoConfig, AutoModelForCausalLM

from colosync import Sender
from colosync.engines.config import Generate
from colosync.engines.process import EngineConfig, EngineProcess, connect
from colosync.sources.megatron import ConversionContext, MegatronSource, ParallelGroups
from colosync.testing import greedy, make_tiny_llama


def train_rank(rank, model_dir, address):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    dist.init_process_group("gloo", rank=rank, world_size=2)  # torchrun and NCCL in a real job
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    hf = AutoConfig.from_pretrained(model_dir)  # the engine's model; the trainer's must have its geometry
    config = TransformerConfig(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads,
        kv_channels=hf.hidden_size // hf.num_attention_heads, normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        tensor_model_parallel_size=2, use_cpu_initialization=True, params_dtype=torch.float32,
    )  # fmt: skip
    model = GPTModel(  # your trainer's model; here random weights
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=hf.vocab_size,
        max_sequence_length=128, position_embedding_type="rope", share_embeddings_and_output_weights=False,
    )  # fmt: skip
    ctx = ConversionContext.from_megatron(
        config, vocab_size=hf.vocab_size, padded_vocab_size=hf.vocab_size, kind="full", lora=None,
        tie_word_embeddings=False, arch="llama",  # "qwen2", "qwen3", "qwen3_moe": colosync.sources.architectures
    )  # fmt: skip
    source = MegatronSource(model, ctx, ParallelGroups.from_megatron())  # collective: every rank checks its shards
    sender = Sender(connect(address, "hf")) if source.is_sender else None
    report = source.push(sender)  # every rank calls it; TP rank 0 gathers its peer's shards and sends
    named = {name: t.clone() for name, t in source.tensors()}  # collective again: the HF weights, on rank 0 only
    if sender is not None:
        reference = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)  # what the engine must now compute
        reference.load_state_dict(named)
        gen = sender.link.call(Generate(prompts=[[1, 5, 9]], max_new_tokens=8))
        assert gen.update_id == report.update_id and gen.tokens == greedy(reference, [[1, 5, 9]], 8)[0]
        sender.close()
        print(f"rank {rank}: update {report.update_id}, {report.tensors} HF tensors in {report.buckets} buckets")
    dist.barrier()  # leave together: a rank that tears its group down early can abort its peer
    dist.destroy_process_group()


if __name__ == "__main__":  # mp.spawn and the engine start fresh processes: guard the entry point
    model_dir = str(make_tiny_llama(tempfile.mkdtemp() + "/tiny-llama", seed=0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    with EngineProcess(EngineConfig(engine="hf", model_dir=model_dir)) as engine:
        mp.spawn(train_rank, args=(model_dir, engine.address), nprocs=2)
        gen = engine.call(Generate(prompts=[[1, 5, 9]], max_new_tokens=8))
    assert gen.update_id == 1, "the engine serves the trainer's weights"
    print("the engine serves the Megatron model's weights:", gen.tokens[0])

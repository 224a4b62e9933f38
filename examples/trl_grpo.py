"""TRL's GRPOTrainer with its colocated vLLM, synced by colosync: one verified adapter-only push per step."""

import os
import tempfile

from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig

from colosync.integrations.trl import ColosyncGRPOTrainer, ColosyncOptions
from colosync.testing import make_tiny_llama


def low_ids(completion_ids, **_):  # the reward: the share of completion tokens below id 64
    return [sum(t < 64 for t in ids) / max(len(ids), 1) for ids in completion_ids]


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU backend only
    model_dir = make_tiny_llama(tempfile.mkdtemp() + "/tiny-llama", seed=0)  # a local model, nothing downloaded
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, 512)}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(model_dir)  # TRL's vLLM loads the tokenizer from the model's folder
    trainer = ColosyncGRPOTrainer(  # GRPOTrainer's arguments, plus colosync=
        model=str(model_dir),
        reward_funcs=low_ids,
        args=GRPOConfig(
            output_dir=tempfile.mkdtemp(),
            use_vllm=True,
            vllm_mode="colocate",  # the engine lives in the trainer's process
            max_steps=3,
            logging_steps=1,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=8,
            vllm_max_model_length=128,
            use_cpu=True,
            report_to=[],
        ),
        train_dataset=Dataset.from_dict({"prompt": ["w5 w9 w13 w200", "w7 w300 w41 w8"] * 16}),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
        colosync=ColosyncOptions(engine_kwargs={"enforce_eager": True}),  # extra vllm.LLM arguments
    )
    trainer.train()  # each step: one LoRA push (no merge, no per-tensor load_weights), verified by a probe
    for report in trainer.colosync_reports:
        print(f"update {report.update_id}: {report.kind}, {report.bytes} bytes, {report.seconds['total'] * 1e3:.0f} ms")
    assert [r.kind for r in trainer.colosync_reports] == ["lora"] * 3
    print({k: v for k, v in trainer.state.log_history[-2].items() if k.startswith(("colosync/", "reward"))})  # logged

"""tie_output_embeddings under TRL's SFTTrainer, against the stock tied model.

SFTTrainer replaces the model's forward with its fused one, which takes its own chunked loss
from the decoder's hidden states and ``lm_head.weight`` (the tied head's, the embedding's):
the model trains as the stock one whether it is tied before the trainer is built or after;
switching ``chunked_loss`` under TRL's wrapper is refused, naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.nn.hf_models import TRAINING, VOCAB, llama
from toolkit.nn import tie_output_embeddings

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

# TRL 1.16's SFTConfig reads a TrainingArguments field that transformers 5.23 deprecates.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`gradient_checkpointing` is deprecated:FutureWarning"
)

WRAPPER = "trl.trainer.utils.add_fused_lm_head.<locals>._fused_forward"


def trainer(model: torch.nn.Module, output: Path) -> object:
    from tokenizers import Tokenizer, models  # noqa: PLC0415 - transformers' dependency
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    words = models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(words), pad_token="t0", eos_token="t2"
    )
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, VOCAB, (9,), generator=generator).tolist() for _ in range(8)]
    args = trl.SFTConfig(output_dir=str(output), **TRAINING, disable_tqdm=True)
    data = datasets.Dataset.from_list([{"input_ids": row} for row in rows])
    return trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)


def trained(sft: object) -> tuple[list[float], torch.Tensor]:
    sft.train()  # type: ignore[attr-defined]
    history = sft.state.log_history  # type: ignore[attr-defined]
    model = sft.model  # type: ignore[attr-defined]
    return [e["loss"] for e in history if "loss" in e], model.get_input_embeddings().weight


@pytest.mark.parametrize("chunked_loss", [False, True])
@pytest.mark.parametrize("when", ["before", "after"])
def test_the_tied_model_trains_as_the_stock_model_or_is_refused_naming_trl(
    tmp_path: Path, when: str, chunked_loss: bool
) -> None:
    torch.manual_seed(0)
    expected_losses, expected_weight = trained(trainer(llama(), tmp_path / "stock"))
    torch.manual_seed(0)
    model = llama()
    if when == "before":
        tie_output_embeddings(model, chunked_loss=chunked_loss)
    sft = trainer(model, tmp_path / "tied")
    if when == "after" and chunked_loss:
        with pytest.raises(ValueError, match=WRAPPER) as error:
            tie_output_embeddings(model, chunked_loss=True)
        assert "chunked_loss=False" in str(error.value)
        assert type(model.lm_head) is torch.nn.Linear  # nothing changed
        return
    if when == "after":
        tie_output_embeddings(model)
    losses, weight = trained(sft)
    assert len(losses) == 2
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight, expected_weight, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("enabled", [False, True])
def test_switching_the_chunked_loss_under_trls_wrapper_is_refused_naming_it(
    tmp_path: Path, enabled: bool
) -> None:
    model = llama()
    tie_output_embeddings(model, chunked_loss=True)
    trainer(model, tmp_path)
    with pytest.raises(ValueError, match=WRAPPER):
        tie_output_embeddings(model, chunked_loss=enabled)

"""Perplexity by evaluation length, as an `evaluate` module (load it from this folder's path, offline).

    import evaluate
    metric = evaluate.load("lex/metrics/length_perplexity")
    metric.compute(predictions=texts, model_id="runs/demo/xpos", lengths=[64, 256, 1024],
                   protocol="segments", attention_mode="blockwise")

`protocol="segments"` is the LEX paper's (the first max(lengths) tokens of each text cut into non-overlapping
segments of each length, each read from a cold start); `protocol="strided"` moves a window of each length by
half a window, so every scored token has as much context as the length allows. A LEX model in blockwise or
sliding mode reads a window of any length (a 1,000,000-token document) in memory that does not grow with it.
"""

import datasets
import evaluate
from transformers import AutoTokenizer

from lex.data import tokenized_documents
from lex.models import load_model
from lex.perplexity import perplexity_by_length

_CITATION = """@article{sun2022length,
  title={A Length-Extrapolatable Transformer},
  author={Sun, Yutao and Dong, Li and Patra, Barun and Ma, Shuming and Huang, Shaohan and Benhaim, Alon
          and Chaudhary, Vishrav and Song, Xia and Wei, Furu},
  journal={arXiv preprint arXiv:2212.10554},
  year={2022}
}"""

_INPUTS = """
Args:
    predictions (list[str]): evaluation documents.
    model_id (str): a model folder or Hub id (a LEX folder, or any causal LM).
    lengths (list[int]): evaluation lengths; every length is scored on the same tokens.
    protocol (str): "segments" (default) or "strided".
    attention_mode (str, optional): override a LEX model's attention_mode ("full", "blockwise", "sliding"); a
        Llama, Mistral or Qwen2 model is converted in memory for "blockwise" and "sliding".
    attention_window (int, optional), attention_sinks (int, optional): override the window and the sinks.
    batch_size (int): windows per forward. device (str): "cpu" (default) or "cuda".
    progress (bool): a progress bar in tokens read.
Returns:
    {"lengths": [...], "perplexities": [...], "tokens": [...]}
"""


class LengthPerplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=__doc__,
            citation=_CITATION,
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value("string")}),
        )

    def _compute(self, predictions, model_id, lengths, protocol="segments", attention_mode=None, batch_size=8,
                 device="cpu", progress=False, attention_window=None, attention_sinks=None):
        model = load_model(model_id, attention_mode, device, attention_window=attention_window,
                           attention_sinks=attention_sinks)
        documents = tokenized_documents(AutoTokenizer.from_pretrained(model_id), predictions)
        scores = perplexity_by_length(model, documents, sorted(lengths), protocol, batch_size, progress)
        return {
            "lengths": list(scores),
            "perplexities": [score.ppl for score in scores.values()],
            "tokens": [score.tokens for score in scores.values()],
        }

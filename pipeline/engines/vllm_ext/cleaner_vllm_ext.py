"""Runs *inside* a vLLM server (its own virtualenv), never in cleaner: a worker extension
(`--worker-extension-cls cleaner_vllm_ext.CleanerWorkerExtension`, this folder on the server's PYTHONPATH)
whose methods `/collective_rpc` calls on every worker. It imports nothing from cleaner.

Why: vLLM 0.32's `reload_weights` leaves a tied lm_head serving the *old* weights on the CPU build. The CPU
GEMM packs its own copy of each linear weight when the layer is prepared (dispatch_cpu_unquantized_gemm); on
reload only layers that receive weights are prepared again, and a tied lm_head receives none (its weight is
the embedding's). Measured here: after a reload the logits were those of the new body with the old head.
"""

from __future__ import annotations


class CleanerWorkerExtension:
    def load_checkpoint(self, weights_path: str) -> str:
        """reload_weights from a checkpoint directory, then prepare a tied lm_head again from the embedding."""
        from vllm.config import set_current_vllm_config

        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        config = getattr(model, "config", None)
        head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        if not (
            getattr(config, "tie_word_embeddings", False)
            and head is not None
            and embed is not None
            and hasattr(head, "quant_method")
            and hasattr(embed, "weight")
        ):
            return "reloaded"
        with set_current_vllm_config(self.vllm_config):
            if head.weight is not embed.weight:
                head.weight = embed.weight
            head.quant_method.process_weights_after_loading(head)
        return "reloaded, tied lm_head prepared again"

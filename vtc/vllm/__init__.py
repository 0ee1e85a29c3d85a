"""The vLLM backend: a `vllm.general_plugins` entry point (`vtc.vllm.plugin`), the five families' model classes
calling vtc's connect engine (`vtc.vllm.models`, imported by vLLM only), the serving config and its checks
(`vtc.vllm.config`) and client helpers (`vtc.vllm.client`). See docs/serving.md."""

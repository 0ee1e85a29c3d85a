"""vtc inside lmms-eval: the `vtc` model (`lmms-eval --model vtc --model_args pretrained=...,methods=...`),
registered through the `lmms_eval.models` entry point. Nothing here is imported by `import vtc`: lmms-eval is
loaded only when it loads this model."""

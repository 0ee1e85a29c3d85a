"""The payload of vtc's `lmms_eval.models` entry point: lmms-eval reads it when it builds its model registry,
and imports the model class only when a run asks for `--model vtc`."""

from lmms_eval.models.registry_v2 import ModelManifest

MANIFESTS = [ModelManifest(model_id="vtc", chat_class_path="vtc.lmms_eval.model.VtcModel")]

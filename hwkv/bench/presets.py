"""The model presets' old home: re-exports `hwkv.engine.presets`, whose public names are a contract."""
from hwkv.engine.presets import (KV_DTYPE_BYTES, MAX_LAYERS, PRESETS, SINKS_CHOICES, LayerGeometry, ModelShape,
                                 add_model_arguments, custom_shape, get_preset, layer_pattern, shape_from_args)

__all__ = ["KV_DTYPE_BYTES", "MAX_LAYERS", "PRESETS", "SINKS_CHOICES", "LayerGeometry", "ModelShape",
           "add_model_arguments", "custom_shape", "get_preset", "layer_pattern", "shape_from_args"]

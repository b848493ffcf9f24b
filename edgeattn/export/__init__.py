"""Export to ONNX (``export_model``, needs the train extra) and the artifact manifest (base install)."""

from edgeattn.artifact.manifest import FORMAT_VERSION, MANIFEST, Manifest, StateEntry

__all__ = ["FORMAT_VERSION", "MANIFEST", "Manifest", "StateEntry", "export_model"]


def __getattr__(name):
    if name == "export_model":
        from edgeattn.export.exporter import export_model

        return export_model
    raise AttributeError(name)

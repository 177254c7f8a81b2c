"""ComfyUI entry point. The comfy imports are guarded so that `import lora_engine` and the tests
work without ComfyUI."""

import sys

WEB_DIRECTORY = "./web"
NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}

if __package__:  # imported as a package, as ComfyUI imports a custom-node folder
    from . import lora_engine as _engine
    from .lora_engine import grid as _grid  # noqa: F401  (loaded here so that it is aliased below)

    # The nodes import the engine by its own name. Registering the package and its submodules (rather
    # than putting this folder on sys.path) keeps `nodes`, `tools` and `tests` here from shadowing other
    # modules, and keeps one copy of every engine module.
    for _name, _module in list(sys.modules.items()):
        if _name == _engine.__name__ or _name.startswith(_engine.__name__ + "."):
            sys.modules.setdefault("lora_engine" + _name[len(_engine.__name__):], _module)

    try:
        import comfy  # noqa: F401
    except ImportError:  # imported outside ComfyUI (tests, tools)
        pass
    else:
        from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]

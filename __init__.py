"""ComfyUI entry point. The nodes import ComfyUI, so they are imported only where it is there: `import lora_engine`
and the tests work without it."""

WEB_DIRECTORY = "./web"
NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}

if __package__:  # imported as a package, as ComfyUI imports a custom-node folder
    try:
        import comfy  # noqa: F401
    except ImportError:  # imported outside ComfyUI (tests, tools)
        pass
    else:
        from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]

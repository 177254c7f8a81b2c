// Written by tools/web_constants.py from lora_engine/stack/pairs.py, their one source: edit that file and
// run the tool again.
export const TARGETS = Object.freeze(["both", "high", "low"]) // which models a row goes to
export const AUTO = "auto" // a row's low file: its partner by name, else its own file

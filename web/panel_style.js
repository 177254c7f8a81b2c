/** The CSS of the rows panel (panel.js): one 20 px line per LoRA. */

const STYLE_ID = 'multilora-rows-style'

const CSS = `
.mlora-panel { box-sizing: border-box; display: flex; flex-direction: column; gap: 0; padding: 2px 4px;
  font: 11px/1.2 sans-serif; color: var(--input-text, #ddd); overflow: hidden; }
.mlora-list { display: flex; flex-direction: column; }
.mlora-row { box-sizing: border-box; height: 20px; margin-bottom: 2px; padding: 0 2px; border-radius: 4px;
  background: var(--comfy-input-bg, #222); display: flex; align-items: center; gap: 4px; min-width: 0; }
.mlora-row[data-enabled="false"] > :not(.mlora-toggle):not(.mlora-grip):not(.mlora-tools) { opacity: 0.45; }
.mlora-row[data-dragging="true"] { outline: 1px dashed var(--border-color, #777); }
.mlora-row[data-drop="above"] { box-shadow: inset 0 2px 0 #4caf50; }
.mlora-row[data-drop="below"] { box-shadow: inset 0 -2px 0 #4caf50; }
.mlora-grip { flex: none; width: 8px; cursor: grab; color: var(--descrip-text, #777); font-size: 9px;
  letter-spacing: -3px; user-select: none; touch-action: none; }
.mlora-toggle, .mlora-toggleAll { flex: none; width: 14px; height: 14px; border-radius: 50%; padding: 0;
  cursor: pointer; border: 1px solid var(--border-color, #555); background: transparent; }
.mlora-row[data-enabled="true"] .mlora-toggle, .mlora-header[data-all-on="true"] .mlora-toggleAll {
  background: #4caf50; border-color: #4caf50; }
.mlora-row[data-enabled="linked"] .mlora-toggle { cursor: default; border-style: dashed; }
button.mlora-name { flex: 1 1 auto; min-width: 0; height: 18px; padding: 0 2px; border: 0; background: none;
  color: inherit; font: 600 11px/18px sans-serif; text-align: left; overflow: hidden; white-space: nowrap;
  text-overflow: ellipsis; cursor: pointer; }
button.mlora-name:hover:not(:disabled) { text-decoration: underline; }
.mlora-row[data-empty="true"] .mlora-name { font-style: italic; font-weight: 400; color: var(--descrip-text, #999); }
.mlora-mark { flex: none; width: 12px; text-align: center; font-size: 10px; cursor: help; }
.mlora-mark[data-kind="slot"] { color: #4caf50; }
.mlora-mark[data-kind="cached"] { color: #42a5f5; }
.mlora-mark[data-kind="idle"] { color: var(--descrip-text, #888); }
.mlora-mark[data-kind="partial"] { color: #ffa726; }
.mlora-mark[data-kind="masked"] { color: #ba68c8; }
.mlora-mark[data-kind="error"] { color: var(--error-text, #ff6b6b); }
.mlora-row button.mlora-target { flex: none; width: 26px; height: 16px; padding: 0; border-radius: 3px;
  border: 1px solid var(--border-color, #555); background: var(--comfy-menu-bg, #333); color: inherit;
  font: 10px/14px sans-serif; cursor: pointer; }
.mlora-row button.mlora-target[data-target="both"] { color: #4caf50; }
button.mlora-low { flex: 1 1 auto; min-width: 0; max-width: 45%; height: 18px; padding: 0 2px; border: 0;
  background: none; color: var(--descrip-text, #bbb); font: 11px/18px sans-serif; text-align: left; overflow: hidden;
  white-space: nowrap; text-overflow: ellipsis; cursor: pointer; }
button.mlora-low:hover:not(:disabled) { text-decoration: underline; }
button.mlora-low[data-kind="named"] { color: inherit; font-weight: 600; }
button.mlora-low[data-kind="same"], button.mlora-low[data-kind="loading"] { font-style: italic; }
button.mlora-low[data-kind="error"] { color: var(--error-text, #ff6b6b); }
.mlora-nums { flex: none; display: flex; gap: 2px; }
.mlora-num { box-sizing: border-box; width: 40px; height: 16px; border-radius: 3px; text-align: center;
  font: 11px/16px monospace; background: var(--comfy-menu-bg, #333); cursor: ew-resize; user-select: none;
  touch-action: none; }
.mlora-num[data-linked="true"] { cursor: default; color: var(--descrip-text, #999); }
.mlora-num[data-dragging="true"] { outline: 1px solid #4caf50; }
.mlora-edit { box-sizing: border-box; width: 100%; height: 16px; border: 1px solid #4caf50; padding: 0 2px;
  background: var(--comfy-input-bg, #111); color: inherit; font: 11px/14px monospace; text-align: center; }
.mlora-row button.mlora-up, .mlora-row button.mlora-down, .mlora-row button.mlora-remove { flex: none; width: 14px;
  height: 16px; padding: 0; border: 0; background: none; color: var(--descrip-text, #aaa); font-size: 9px;
  cursor: pointer; }
.mlora-row button.mlora-up:hover, .mlora-row button.mlora-down:hover, .mlora-row button.mlora-remove:hover {
  color: var(--input-text, #eee); }
.mlora-row button:disabled { opacity: 0.25; cursor: default; }
.mlora-footer, .mlora-header { display: flex; align-items: center; gap: 6px; }
.mlora-header { height: 18px; margin-bottom: 2px; padding: 0 2px 0 12px; }
.mlora-footer { height: 22px; margin-top: 2px; }
.mlora-footer button { cursor: pointer; border: 1px solid var(--border-color, #555);
  background: var(--comfy-menu-bg, #333); color: inherit; border-radius: 3px; font-size: 10px; padding: 0 4px;
  height: 18px; }
.mlora-footer button:disabled { opacity: 0.3; cursor: default; }
.mlora-summary { flex: 1; color: var(--descrip-text, #aaa); }
.mlora-captions { flex: none; display: flex; gap: 2px; margin-right: 54px; color: var(--descrip-text, #888);
  font-size: 10px; }
.mlora-captions > span { width: 40px; text-align: center; white-space: nowrap; }
.mlora-cache { flex: 1; overflow: hidden; white-space: nowrap; text-overflow: ellipsis;
  color: var(--descrip-text, #aaa); }
.mlora-cache[data-error="true"] { color: var(--error-text, #ff6b6b); }
`

export function ensureStyle(doc = document) {
  if (doc.getElementById(STYLE_ID)) return
  const style = doc.createElement('style')
  style.id = STYLE_ID
  style.textContent = CSS
  doc.head.appendChild(style)
}

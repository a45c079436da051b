"""Writes docs/configuration.md from PipelineConfig itself: ``python -m deploy.config_docs > docs/configuration.md``.

A test compares the committed page with this output, so the page never drifts from the code.
"""

from __future__ import annotations

from pydantic import BaseModel

from pipeline.config import PipelineConfig

HEADER = """# Configuration

Every Tandem process is configured by one `pipeline.config.PipelineConfig` (field names follow
Modular MAX's PipelineConfig). Sources, lowest to highest precedence:

1. defaults (below);
2. a YAML or TOML file section: `--config tandem.yaml --section decode` (or `PipelineConfig.load(path, section)`);
3. environment variables: `TANDEM_<FIELD>`, nested sections with `__` (`TANDEM_KV_CACHE__PAGE_SIZE=4`);
4. command-line flags (`--max-batch-size 8`, nested: `--kv-cache-page-size 4`; the model section by vLLM's
   names, `--model PATH`, `--served-model-name`, `--quantization`, `--dtype`, its other fields as
   `--model-device cuda:1`, `--model-seed 7`) or keyword arguments of `LLM(...)` (nested sections as dicts).
   A text field takes a flag's or variable's text as it is (a served name `2024`); other values are read as
   JSON when they parse (numbers, `true`, `null`, a section as an object). A `TANDEM_` variable that names no
   field is ignored (other tools share the prefix), so check a variable's spelling against this table.

A bad value stops the process with one line naming the field and what it accepts, e.g.
`invalid config: kv_cache.page_size: Input should be greater than or equal to 1 (got 0)`.

Example `tandem.yaml` with one section per role:

```yaml
prefill:
  pipeline_role: PrefillOnly
  zmq_endpoint_base: tcp://10.0.0.5:25000
  max_batch_input_tokens: 8192
  model: {model_path: /models/llama-3-8b, dtype: bfloat16}
decode:
  pipeline_role: DecodeOnly
  zmq_endpoint_base: tcp://10.0.0.5:25000
  max_batch_size: 128
  kvcache_ce_watermark: 0.9
  kv_cache: {page_size: 16, device_memory_utilization: 0.9}
  model: {model_path: /models/llama-3-8b, dtype: bfloat16}
```

| field | default | meaning |
|---|---|---|
"""


def _default(field) -> str:
    value = field.default
    return f"`{getattr(value, 'value', value)}`"


def render() -> str:
    rows = []
    for name, field in PipelineConfig.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.append(f"| **`{name}`** | | {annotation.__doc__.strip().splitlines()[0]} |")
            for sub_name, sub_field in annotation.model_fields.items():
                rows.append(f"| `{name}.{sub_name}` | {_default(sub_field)} | {sub_field.description or ''} |")
        else:
            rows.append(f"| `{name}` | {_default(field)} | {field.description or ''} |")
    return HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(render(), end="")

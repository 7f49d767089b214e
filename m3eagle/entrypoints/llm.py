"""The offline API, shaped like vLLM's: LLM(model=...).generate(prompts, SamplingParams(...)) and
LLM.chat(messages) (the model's chat template, rendered as the server renders it)."""

from __future__ import annotations

from typing import Any

from m3eagle.engine.llm_engine import RequestError
from m3eagle.engine.request import RequestOutput
from m3eagle.engine.runtime import Runtime
from m3eagle.entrypoints.chat import ChatTemplate, ChatTemplateError, check_messages
from m3eagle.entrypoints.tools import ToolsError, check_tools
from m3eagle.loader.tokenizer import Tokenizer
from m3eagle.sampling.params import SamplingParams


class LLM(Runtime):
    """The offline engine: a Runtime (every constructor option is documented there: model, draft,
    num_draft_tokens, dtype, device, overlap, backends, CUDA graphs, multi-step, tensor parallelism) with chat()
    on the model's chat template."""

    _chat_template: ChatTemplate | None = None

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
             **template_kwargs: Any) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list of them.
        Each is rendered with the model's chat_template (tokenizer_config.json) exactly as the server's
        /v1/chat/completions renders it, then generated like a text prompt.

        tools: OpenAI-shaped function tools, rendered by the template (its `tools` variable). The outputs stay
        plain text, as in vLLM: `m3eagle.entrypoints.parsers.parse_output(text, tools, prompt)` turns one
        into content, reasoning_content and tool_calls."""
        if self.tokenizer_path is None:
            raise ValueError("chat needs a model (or tokenizer=) directory with a tokenizer_config.json "
                             "chat_template; this LLM was built from a config")
        if self._chat_template is None:
            self._chat_template = ChatTemplate.from_model_dir(self.tokenizer_path)
        if self._chat_template is None:
            raise ValueError(f"{self.tokenizer_path / 'tokenizer_config.json'} has no chat_template (nor is there a "
                             "chat_template.jinja beside it): add one, or call generate() with plain prompts")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of {'role', 'content'} dicts, or a list of those")
        if tools is not None:
            try:
                tools = check_tools(tools)
            except ToolsError as e:
                raise RequestError(str(e)) from None
        many = isinstance(messages[0], list)
        conversations = messages if many else [messages]
        prompts = []
        for i, c in enumerate(conversations):  # every conversation checked before any is rendered or runs
            checked = check_messages(c, f"conversations[{i}].messages" if many else "messages")
            try:
                prompts.append(self._chat_template.render(checked, add_generation_prompt, False, tools,
                                                          **template_kwargs))
            except ChatTemplateError as e:
                raise RequestError(f"conversation {i}: {e}" if many else str(e)) from None
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_tokenizer(self) -> Tokenizer:
        """The loaded tokenizer (vLLM's LLM.get_tokenizer): encode(text) -> ids, decode(ids) -> text. A
        ValueError when the model directory has no tokenizer.json (or the LLM was built from a config)."""
        if self.tokenizer is None:
            where = self.model_path if self.model_path is not None else "a config (no model directory)"
            raise ValueError(f"this LLM has no tokenizer: {where} has no tokenizer.json; prompts must be token ids")
        return self.tokenizer

"""The family-neutral chat core: every chat-shaped API (OpenAI chat, Responses, Anthropic
Messages) translates its body into a `ChatRequest`, which `ChatCore` renders once
(`RenderedPrompt`), plans the output of (`OutputPlan`) and admits as one engine job."""

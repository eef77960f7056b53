"""The OpenAI protocol: request models and their conversion to a GenerateRequest, refused
fields, chat messages, structured outputs, tools, logprobs shapes."""

"""nbexec for LLM tool use: tool definitions, tool-call handlers, the MCP server and LangChain.

    tools      what the model is told and what it gets back (pure)
    toolcall   run a model's tool call, answer in that API's shape (OpenAI, Anthropic)
    mcp        `nbexec mcp`: the MCP server (the mcp extra)
    langchain  a LangChain tool (the langchain extra)
"""

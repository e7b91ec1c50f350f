"""pagelm's built-in demo model: a few-million-parameter Llama trained locally on Python's
standard library the first time it is asked for (``pagelm.plugins.demo.model``), and
``python -m pagelm.plugins.demo`` to try it through the offline ``LLM`` API."""

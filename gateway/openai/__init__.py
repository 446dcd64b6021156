"""OpenAI-compatible routes: models, completions, chat completions, files and the Batch API.

`schema` maps OpenAI request bodies onto carpool job messages, `responses`
maps job records back onto OpenAI objects, `online` serves the completion
routes (with `streaming`), `files` and `batches` hold the Batch API's Redis
state, and `batch_driver` moves batches along in the background.
"""

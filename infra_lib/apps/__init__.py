"""L6 applications: what is built on top of the serving engine.

    rag/      retrieval-augmented generation: loaders, chunking, embeddings, vector search,
              context assembly and evaluation (chapter 12)
    agents/   state graphs, tools, retries and checkpoints (chapter 13)

Import the subpackage you need (``from infra_lib.apps.rag import RAGPipeline``); this package
imports neither, so each stays as light as its own dependencies.
"""

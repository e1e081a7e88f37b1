"""An LCEL RAG chain over real Wikipedia leads on the embedded engine, printing the
prompt tokens vLLM served from its prefix cache on every call.

    .venv/bin/python examples/lcel_rag.py [--questions 6]

The retriever is a plain keyword retriever over ~2,000 leads indexed twice (whole leads
and overlapping windows, as chunkers produce them); ``PromptspliceRetriever`` dedups what
it returns (provenance in each document's metadata) and orders it canonically, so
questions that retrieve the same passages send the same prefix and hit the cache.
"""

import argparse

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda, RunnablePassthrough

from promptsplice.benchmarks.cli import count_arg
from promptsplice.benchmarks.traces import load_wiki_leads
from promptsplice.assembler import Assembler
from promptsplice.engine_adapters import EmbeddedEngine, PromptspliceChatModel, PromptspliceRetriever


class KeywordRetriever(BaseRetriever):
    """Documents ranked by how many of the query's words they contain."""

    docs: list[Document]
    top: int = 6

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        words = {w.lower().strip(".,?") for w in query.split() if len(w) > 3}
        scored = [(sum(w in d.page_content.lower() for w in words), -i, d) for i, d in enumerate(self.docs)]
        scored.sort(key=lambda x: (x[0], x[1]), reverse=True)
        return [d for s, _, d in scored[: self.top] if s > 0]


def corpus(n: int = 2000) -> list[Document]:
    docs = []
    for i, (title, lead) in enumerate(load_wiki_leads()[:n]):
        docs.append(Document(lead, id=f"lead-{i}", metadata={"title": title}))
        half = len(lead) // 2
        docs.append(Document(lead[half // 2 : half + half // 2], id=f"win-{i}", metadata={"title": title}))
    return docs


QUESTIONS = [
    "What styles shaped twentieth century classical music?",
    "Which music movements started in the twentieth century?",
    "What styles shaped twentieth century classical music?",
    "Tell me about modernism and century music styles.",
    "What styles shaped twentieth century classical music?",
    "Which movements in music came after 1900?",
]


def run(engine: EmbeddedEngine, questions: list[str]) -> list[tuple[int, int, str]]:
    """Ask each question through the chain; returns (prompt tokens, cache reads, answer)."""
    llm = PromptspliceChatModel(engine=engine, max_tokens=48)
    # an assembler of its own: the order it learns is this chain's (the shared default
    # would carry whatever else the process assembled, and so would the answers)
    order = Assembler(engine.tokenizer, block_size=engine.block_size, policy="stable")
    retriever = PromptspliceRetriever(retriever=KeywordRetriever(docs=corpus()), k=4, assembler=order)
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer from the passages only, in one sentence.\n\nPassages:\n{context}"),
        ("human", "{question}"),
    ])
    fmt = RunnableLambda(lambda docs: "\n\n".join(d.page_content for d in docs))
    chain = {"context": retriever | fmt, "question": RunnablePassthrough()} | prompt | llm
    out = []
    for q in questions:
        msg = chain.invoke(q)
        usage = msg.usage_metadata or {}
        cached = int((usage.get("input_token_details") or {}).get("cache_read") or 0)
        answer = StrOutputParser().invoke(msg)
        out.append((int(usage.get("input_tokens", 0)), cached, answer))
        print(f"{out[-1][0]:5d} prompt tokens, {cached:5d} from the prefix cache | {q}")
        print(f"      -> {answer[:100]!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=count_arg(1), default=len(QUESTIONS),
                    help=f"ask the first N of the {len(QUESTIONS)} questions (default: all)")
    args = ap.parse_args(argv)
    if args.questions > len(QUESTIONS):  # before the engine starts: it asked fewer, silently
        ap.error(f"--questions: at most {len(QUESTIONS)} (the example's questions), got {args.questions}")
    engine = EmbeddedEngine()
    try:
        run(engine, QUESTIONS[: args.questions])
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

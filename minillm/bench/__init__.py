"""`python -m minillm.bench SUITE`: every measured figure of the course, against transformers and llama.cpp."""

"""`--train-backend megatron`: megatron-core's GPTModel as the actor of the shared step loop.

Owns the model built from a Hugging Face config and its weight mapping (`model`), the backend
that brings it to the step loop (`backend`: its forward, gradient sums and weights), pipeline and context parallelism (`pipeline`,
`context`), megatron's distributed optimizer (`optimizer`), torch_dist checkpoints (`dist`),
and the explicit CPU compatibility patches (`cpu`, applied when the backend starts, never at
import). Imported only when that backend is asked for: megatron-core is an optional extra.
"""

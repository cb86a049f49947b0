"""The compiler: candidate space, cost model, proposer agents, verification, ledger, compile loop."""

"""The merge: fold updates, merge a round, apply the outer step (numpy only, no HTTP, no run state)."""

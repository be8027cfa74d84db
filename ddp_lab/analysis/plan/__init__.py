"""`python -m ddp_lab.plan`: which layout? Every axis priced in closed form (price.py), every layout that divides
enumerated and ranked (search.py), the command line (cli.py); the model shapes it prices (shapes.py). docs/plan.md
says how to read it and what it has not yet been checked against."""

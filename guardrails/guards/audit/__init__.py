"""CollectiveAuditor: every rank's collectives recorded and compared off the training
group; a mismatch named on every rank.
"""

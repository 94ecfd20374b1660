"""pipeline/submit"""
